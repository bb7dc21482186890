"""A /v1/responses body read into the chat request that serves it: items to messages, tools and text.format to
chat's fields, and what is refused named as the Responses API names it."""

from __future__ import annotations

import pytest

from gateway.api_error import APIError
from gateway.openai.request_limits import DEFAULT_LIMITS, RequestLimits
from gateway.openai.responses_api import (
    chat_messages,
    input_items,
    parse_responses_body,
    previous_response_id,
)


def parse(history=(), tool_call_parser="hermes", limits=DEFAULT_LIMITS, **body):
    return parse_responses_body(
        {"model": "tiny", "input": "Hi"} | body, list(history), ["tiny"], tool_call_parser, limits
    )


def refused(param: str, **body) -> str:
    with pytest.raises(APIError) as caught:
        parse(**body)
    assert caught.value.status == 400 and caught.value.param == param, caught.value.message
    return caught.value.message


def test_items_become_the_messages_the_model_wrote():
    items = input_items(
        [
            {"role": "developer", "content": "Be brief."},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Weather in "},
                    {"type": "input_text", "text": "Paris?"},
                ],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
            },
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
        ],
        DEFAULT_LIMITS,
    )
    messages = chat_messages("Instructions.", items)
    assert [m["role"] for m in messages] == ["system", "system", "user", "assistant", "tool"]
    assert messages[2]["content"] == "Weather in Paris?"
    assert messages[3]["content"] == "Let me look." and [c["id"] for c in messages[3]["tool_calls"]] == [
        "call_1",
        "call_2",
    ]
    assert messages[4] == {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}


def test_history_comes_before_input_and_instructions_first():
    history = [
        {"type": "message", "role": "user", "content": "I am Ada."},
        {"type": "message", "role": "assistant", "content": "Hello Ada."},
    ]
    turn = parse(
        history, instructions="Short answers.", input="Who am I?", max_output_tokens=7, metadata={"a": "b"}
    )
    assert [m.content for m in turn.chat.messages] == [
        "Short answers.",
        "I am Ada.",
        "Hello Ada.",
        "Who am I?",
    ]
    assert turn.items == [*history, {"type": "message", "role": "user", "content": "Who am I?"}]
    assert turn.chat.max_tokens == 7 and turn.store and turn.echo["metadata"] == {"a": "b"}


def test_tools_text_format_and_tool_choice_translate():
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
    turn = parse(tools=[tool], tool_choice={"type": "function", "name": "f"})
    assert turn.chat.tools.choice == "function" and turn.chat.tools.function == "f"
    assert turn.chat.sampling.structured_outputs is not None and turn.echo["tools"][0]["strict"] is True
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    turn = parse(text={"format": {"type": "json_schema", "name": "x", "schema": schema}})
    assert turn.chat.constraint_field == "text.format.schema"  # what the executor's grammar errors name
    assert turn.chat.sampling.structured_outputs.json is not None
    assert parse(text={"format": {"type": "json_object"}}).chat.sampling.structured_outputs.json_object


def test_refusals_name_the_responses_fields():
    assert "web_search" in refused("tools[0].type", tools=[{"type": "web_search_preview"}])
    assert "mcp" in refused("tools[1].type", tools=[{"type": "function", "name": "f"}, {"type": "mcp"}])
    refused("tools[0].name", tools=[{"type": "function", "name": "no spaces"}])
    refused(
        "tool_choice.name",
        tools=[{"type": "function", "name": "f"}],
        tool_choice={"type": "function", "name": "g"},
    )
    refused("tool_choice", tool_choice={"type": "file_search"})
    refused("max_output_tokens", max_output_tokens=-1)
    refused("text.format.name", text={"format": {"type": "json_schema", "schema": {}}})
    refused("text.format.type", text={"format": {"type": "yaml"}})
    for name, value in [
        ("prompt", {"id": "p"}),
        ("conversation", "c"),
        ("prompt_cache_key", "k"),
        ("top_logprobs", 2),
    ]:
        assert name in refused(name, **{name: value})
    refused("background", background=True)
    refused("truncation", truncation="auto")
    refused("input[0].type", input=[{"type": "reasoning", "summary": []}])
    refused("input[0].content[0].type", input=[{"role": "user", "content": [{"type": "input_file"}]}])
    refused(
        "input[0].arguments",
        input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}],
    )
    refused("input[0].role", input=[{"role": "critic", "content": "x"}])
    refused("input", limits=RequestLimits(max_messages=2), input=["a", "b", "c"])
    assert parse(background=False, include=[], reasoning={"effort": None}, truncation="disabled").store


def test_metadata_bounded_as_openai_bounds_it():
    assert parse(metadata={f"k{i}": "v" * 512 for i in range(16)}).echo["metadata"]
    refused("metadata", metadata={f"k{i}": "v" for i in range(17)})
    refused("metadata", metadata={"k" * 65: "v"})
    refused("metadata", metadata={"k": "v" * 513})
    refused("metadata", metadata={"k": 1})


def test_previous_response_id_malformed_reads_as_absent():
    assert previous_response_id({}) is None
    assert previous_response_id({"previous_response_id": "resp_" + "0" * 32}) == "resp_" + "0" * 32
    with pytest.raises(APIError) as caught:
        previous_response_id({"previous_response_id": "resp_../other"})
    assert caught.value.status == 404 and caught.value.param == "previous_response_id"


@pytest.mark.parametrize("tools", [None, [{"type": "function", "name": "get_weather"}]])
def test_a_continued_turn_starts_with_the_last_prompt_and_answer(tokenizer, tools):
    """What routing by cached blocks relies on: turn 2's prompt begins with turn 1's prompt, then the tokens of its
    answer and the end-of-turn token the model wrote last, token for token."""
    from gateway.openai.responses import Generation
    from gateway.openai.responses_events import conversation_items, output_items
    from gateway.prompt.token_ids import prompt_token_ids

    first = parse(instructions="Be brief.", input="My name is Ada.", tools=tools)
    before = prompt_token_ids(first.chat, tokenizer)
    answer = tokenizer.encode("Hello Ada! How can I help you today?", add_special_tokens=False)
    end_of_turn = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    generation = Generation.start(first.chat, before, [], tokenizer)
    generation.feed(answer + end_of_turn, None, "stop", 0)
    history = first.items + conversation_items(output_items(generation))
    second = parse(history, instructions="Be brief.", input="What is my name?", tools=tools)
    after = prompt_token_ids(second.chat, tokenizer)
    assert generation.output.text == tokenizer.decode(answer)  # the end of turn is the template's to write
    assert after[: len(before) + len(answer) + 1] == before + answer + end_of_turn
