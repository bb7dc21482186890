"""A Response's events from a real Generation fed token by token: items open and close in the order the model wrote
them, every event numbered, and the whole answer says what the events said."""

from __future__ import annotations

import json
import typing

from openai.types.responses import Response, ResponseStreamEvent

from gateway.openai.request_limits import DEFAULT_LIMITS
from gateway.openai.responses import Generation
from gateway.openai.responses_api import parse_responses_body
from gateway.openai.responses_events import ResponseEvents, output_items, response_object, usage
from gateway.prompt.token_ids import prompt_token_ids

# the openai SDK's event classes by their `type`
EVENT_TYPES = {
    typing.get_args(cls.model_fields["type"].annotation)[0]: cls
    for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])
}
TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}


def _events(stream: str) -> list[dict]:
    events = []
    for block in stream.split("\n\n"):
        if block:
            kind, data = block.split("\n")
            event = json.loads(data.removeprefix("data: "))
            assert kind == f"event: {event['type']}"
            events.append(event)
    return events


def test_text_then_a_call_streams_as_two_items(tokenizer):
    body = {"model": "tiny", "input": "Weather?", "tools": [TOOL], "metadata": {"k": "v"}}
    turn = parse_responses_body(body, [], ["tiny"], "hermes", DEFAULT_LIMITS)
    ids = prompt_token_ids(turn.chat, tokenizer)
    written = 'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>'
    tokens = tokenizer.encode(written, add_special_tokens=False)
    generation = Generation.start(turn.chat, ids, [], tokenizer)
    stream = ResponseEvents(generation, "resp_" + "0" * 32, 0, turn.echo)
    text = "".join(
        stream.update([token], None, "stop" if i == len(tokens) - 1 else None, 0)
        for i, token in enumerate(tokens)
    )
    events = _events(text)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    for event in events:  # each in the shape the openai SDK's types declare
        EVENT_TYPES[event["type"]].model_validate(event)
    final = events[-1]["response"]
    Response.model_validate(final)
    message, call = final["output"]
    assert message["content"][0]["text"] == "Let me check." and message["status"] == "completed"
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert final["usage"]["output_tokens"] == len(tokens) and final["metadata"] == {"k": "v"}
    # the whole answer of the same generation holds the same items
    whole = output_items(generation)
    Response.model_validate(
        response_object(final["id"], 0, "tiny", turn.echo, whole, "completed", usage(generation))
    )
    assert [(i["type"], i.get("call_id")) for i in whole] == [
        (i["type"], i.get("call_id")) for i in final["output"]
    ]
    assert stream.update([1], None, "stop", 0) == ""  # nothing after the end


def test_cut_short_is_incomplete(tokenizer):
    turn = parse_responses_body({"input": "Hi", "max_output_tokens": 2}, [], ["tiny"], None, DEFAULT_LIMITS)
    generation = Generation.start(turn.chat, prompt_token_ids(turn.chat, tokenizer), [], tokenizer)
    stream = ResponseEvents(generation, "resp_" + "1" * 32, 0, turn.echo)
    events = _events(
        stream.update(tokenizer.encode("Hello there", add_special_tokens=False)[:2], None, "length", 0)
    )
    assert events[-1]["type"] == "response.incomplete"
    response = events[-1]["response"]
    Response.model_validate(response)
    assert response["status"] == "incomplete" and response["incomplete_details"] == {
        "reason": "max_output_tokens"
    }
    assert response["output"][0]["status"] == "incomplete"
