"""The Hermes tool-call parser: whole outputs, the same outputs streamed in pieces of every size, and output that
is not a call falling back to text."""

from __future__ import annotations

import json

import pytest

from gateway.openai.tool_parser import ToolCallParser
from tests.work_counting import Work, assert_linear, count_work

NAMES = ["get_weather", "get_time"]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'


def parse(text: str, step: int | None = None, **options):
    """(content, calls, streamed chunk entries, streamed content) of text fed in pieces of `step` characters."""
    parser = ToolCallParser(NAMES, **options)
    step = step or len(text) or 1
    chunks, streamed = [], ""
    pieces = [text[i : i + step] for i in range(0, len(text), step)] or [""]
    for i, piece in enumerate(pieces):
        content, deltas = parser.feed(piece, finished=i == len(pieces) - 1)
        streamed += content
        chunks += [delta.chunk_entry() for delta in deltas]
    return parser.content, [(c.name, c.arguments) for c in parser.calls], chunks, streamed


def assembled(chunks: list[dict]) -> list[tuple[str, str]]:
    """What a client builds from delta.tool_calls chunks, as the openai SDK does."""
    calls: dict[int, list] = {}
    for entry in chunks:
        call = calls.setdefault(entry["index"], [None, ""])
        if "id" in entry:
            assert entry["id"].startswith("call_") and entry["type"] == "function" and call[0] is None
            call[0] = entry["function"]["name"]
        call[1] += entry["function"]["arguments"]
    return [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("step", [None, 1, 2, 3, 5, 7, 11])
def test_a_call_with_text_before_it(step):
    content, calls, chunks, streamed = parse("Let me look.\n" + CALL + "\n", step)
    assert calls == [("get_weather", '{"city": "Paris", "unit": "c"}')]
    assert content == streamed == "Let me look."  # no tags, no whitespace around the call
    assert assembled(chunks) == calls
    assert json.loads(calls[0][1]) == {"city": "Paris", "unit": "c"}


@pytest.mark.parametrize("step", [None, 1, 4])
def test_several_calls_keys_in_any_order_and_braces_inside_strings(step):
    text = (
        '<tool_call>{"arguments": {"q": ["}", {"a": "\\"}"}]}, "name": "get_weather"}</tool_call>\n'
        '<tool_call>{"name": "get_time"}</tool_call>'
    )
    content, calls, chunks, _ = parse(text, step)
    assert content == "" and calls == [
        ("get_weather", '{"q": ["}", {"a": "\\"}"}]}'),
        ("get_time", "{}"),  # no arguments: an empty object
    ]
    assert assembled(chunks) == calls
    ids = [entry["id"] for entry in chunks if "id" in entry]
    assert len(set(ids)) == 2


def test_arguments_stream_as_they_are_written():
    parser = ToolCallParser(NAMES)
    assert parser.feed("<tool_call>\n") == ("", [])
    assert parser.feed('{"name": "get_wea') == ("", [])  # the name is not complete yet
    _, deltas = parser.feed('ther", "arguments": {"ci')
    assert [d.chunk_entry()["function"] for d in deltas] == [{"name": "get_weather", "arguments": '{"ci'}]
    _, deltas = parser.feed('ty": "Rome"}}\n</tool_call>')
    assert [d.chunk_entry() for d in deltas] == [{"index": 0, "function": {"arguments": 'ty": "Rome"}'}}]


@pytest.mark.parametrize("step", [1, 3])
def test_text_that_may_start_a_tag_is_held_back_then_released(step):
    text = "a <tool_ and <b> </tool_call> <tool_cal"
    content, calls, _, streamed = parse(text, step)
    assert calls == [] and content == streamed == text


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>not json</tool_call>",
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        '<tool_call>{"name": "unknown_tool", "arguments": {}}</tool_call>',
        '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>',  # no name
        '<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call>',  # arguments not an object
        '<tool_call>{"name" "get_weather"}</tool_call>',
    ],
)
@pytest.mark.parametrize("step", [None, 1])
def test_malformed_calls_fall_back_to_text_tags_and_all(block, step):
    text = "Answer: " + block + " done"
    content, calls, chunks, streamed = parse(text, step)
    assert calls == [] and chunks == []
    assert content == streamed == text


def test_a_call_cut_short_stays_a_call_with_what_was_written():
    content, calls, _, _ = parse('<tool_call>{"name": "get_weather", "arguments": {"city": "Par', 2)
    assert content == "" and calls == [("get_weather", '{"city": "Par')]


def test_an_unclosed_block_without_a_name_is_text():
    content, calls, _, _ = parse('<tool_call>{"arguments": {"city": "Par', 2)
    assert calls == [] and content == '<tool_call>{"arguments": {"city": "Par'


def test_text_only_output_is_untouched():
    text = "  Hello,\n world  \n"
    assert parse(text, 1)[0] == parse(text, 1)[3] == text


def test_parallel_tool_calls_false_keeps_the_first_call():
    content, calls, chunks, _ = parse(CALL + CALL.replace("get_weather", "get_time") + " bye", 3, max_calls=1)
    assert [name for name, _ in calls] == ["get_weather"] and content == ""
    assert len(assembled(chunks)) == 1


@pytest.mark.parametrize("step", [None, 1, 6])
def test_constrained_output_is_the_json_alone(step):
    text = '{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
    content, calls, chunks, streamed = parse(text, step, constrained=True)
    assert content == streamed == "" and calls == [("get_time", '{"zone": "UTC"}')]
    assert assembled(chunks) == calls


@pytest.mark.parametrize("step", [None, 1])
def test_constrained_output_that_is_not_a_call_is_text(step):
    text = "I cannot <tool_call> do that"
    content, calls, _, streamed = parse(text, step, constrained=True)
    assert calls == [] and content == streamed == text


def _long_call(size: int) -> str:
    """A call whose every part grows with size: a key, the name (unknown, so it never streams) and a string
    value each about size / 3 characters long."""
    third = "x" * (size // 3)
    return (
        f'<tool_call>{{"{third}": 1, "name": "get_{third}", "arguments": {{"text": "{third}"}}}}</tool_call>'
    )


@pytest.mark.parametrize("constrained", [False, True])
def test_feeding_a_call_in_small_pieces_costs_linear_work(constrained):
    """Each piece is read once: no scan restarts at the call's start, no copy of the text so far."""

    def work(size: int) -> Work:
        text = _long_call(size)
        if constrained:
            text = text.removeprefix("<tool_call>").removesuffix("</tool_call>")
        parser = ToolCallParser(NAMES, constrained=constrained)
        pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
        work = count_work(
            parser.feed, pieces, ("gateway/openai/tool_parser.py", "gateway/openai/tool_call_scan.py")
        )
        parser.feed("", finished=True)
        assert parser.content == text and not parser.calls  # an unknown name: the call is text
        return work

    assert_linear(work(3_000), work(6_000))


@pytest.mark.parametrize("where", ["arguments", "after the object"])
def test_a_long_call_that_streams_costs_linear_work(where):
    """Long arguments stream as they come; text after the closed object (before the tag) is not re-read."""

    def work(size: int) -> Work:
        if where == "arguments":
            text = CALL.replace('"Paris"', '"' + "Paris " * (size // 6) + '"')
        else:
            text = CALL.replace("}}\n", "}} " + "and more " * (size // 9))
        parser = ToolCallParser(NAMES)
        pieces = [text[i : i + 2] for i in range(0, len(text), 2)]
        work = count_work(
            parser.feed, pieces, ("gateway/openai/tool_parser.py", "gateway/openai/tool_call_scan.py")
        )
        assert json.loads(parser.calls[0].arguments)["city"].startswith("Paris")
        assert parser.content == "" and len(parser.calls) == 1
        return work

    assert_linear(work(3_000), work(6_000))
