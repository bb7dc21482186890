"""Chat answers with tools in OpenAI's shape: message.tool_calls and finish_reason "tool_calls" whole, and
delta.tool_calls chunks streamed, from the default model's real tokens."""

from __future__ import annotations

import json

from gateway.openai.request import fit_to_context, parse_chat_request
from gateway.openai.responses import EventStream, Generation, response_body

WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {}}}},
}
OUTPUT = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def generation(tokenizer, **fields) -> Generation:
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER], **fields}
    request = parse_chat_request(json.dumps(body).encode(), ["m"], "hermes")
    params = fit_to_context(request, 3, 2048)
    return Generation.start(request, [1, 2, 3], params.stop, tokenizer)


def feed_tokens(tokenizer, gen: Generation, text: str, finish_reason: str = "stop", logprobs: bool = False):
    """The text's tokens one update each, the last carrying the finish reason: as an executor sends them."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    for i, token_id in enumerate(ids):
        entry = [[token_id, -0.5, 1, []]] if logprobs else None
        yield gen, ([token_id], entry, finish_reason if i == len(ids) - 1 else None, 0)


def whole(tokenizer, text: str, finish_reason: str = "stop", **fields) -> dict:
    gen = generation(tokenizer, **fields)
    for g, update in feed_tokens(tokenizer, gen, text, finish_reason):
        g.feed(*update)
    return response_body(gen)


def streamed(tokenizer, text: str, finish_reason: str = "stop", **fields) -> list[dict]:
    gen = generation(tokenizer, stream=True, **fields)
    stream = EventStream(gen, include_usage=False)
    out = "".join(stream.update(*update) for _, update in feed_tokens(tokenizer, gen, text, finish_reason))
    blocks = [b[len("data: ") :] for b in out.split("\n\n") if b]
    assert blocks[-1] == "[DONE]"
    return [json.loads(b) for b in blocks[:-1]]


def test_whole_answer_has_tool_calls_and_finish_reason_tool_calls(tokenizer):
    body = whole(tokenizer, OUTPUT)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Checking."
    (call,) = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_only_a_call_means_content_null(tokenizer):
    message = whole(tokenizer, OUTPUT.removeprefix("Checking.\n"))["choices"][0]["message"]
    assert message["content"] is None and len(message["tool_calls"]) == 1


def test_text_answer_to_a_tools_request_is_plain_content(tokenizer):
    body = whole(tokenizer, "It is sunny <b>today</b>.")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny <b>today</b>."}
    assert body["choices"][0]["finish_reason"] == "stop"


def test_a_call_cut_by_max_tokens_keeps_length(tokenizer):
    body = whole(tokenizer, OUTPUT[: OUTPUT.index("Paris")], finish_reason="length")
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "'


def test_stream_sends_delta_tool_calls_and_never_the_tags(tokenizer):
    chunks = streamed(tokenizer, OUTPUT)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "Checking." and "<" not in content
    calls = [entry for d in deltas for entry in d.get("tool_calls", [])]
    first = calls[0]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"]["name"] == "get_weather"
    assert all(set(entry) == {"index", "function"} for entry in calls[1:])  # then argument fragments
    assert len(calls) > 2  # the arguments arrive in pieces, as the tokens do
    assert "".join(entry["function"]["arguments"] for entry in calls) == '{"city": "Paris"}'
    assert chunks[-1]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "tool_calls",
    }
    # the same answer as the whole response
    call = whole(tokenizer, OUTPUT)["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["arguments"] == '{"city": "Paris"}'


def test_logprobs_of_held_back_tokens_still_reach_the_client(tokenizer):
    gen = generation(tokenizer, stream=True, logprobs=True)
    stream = EventStream(gen, include_usage=False)
    updates = list(feed_tokens(tokenizer, gen, OUTPUT, logprobs=True))
    out = "".join(stream.update(*update) for _, update in updates)
    chunks = [json.loads(b[len("data: ") :]) for b in out.split("\n\n") if b and b != "data: [DONE]"]
    entries = [
        e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]
    ]
    assert len(entries) == len(updates)  # every token's, tags included


def test_required_output_is_read_as_the_call_json_it_was_constrained_to(tokenizer):
    call_json = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    choice = whole(tokenizer, call_json, tool_choice="required")["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Oslo"}',
    }
    chunks = streamed(
        tokenizer, call_json, tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert not any(d.get("content") for d in deltas)
    calls = [entry for d in deltas for entry in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather"
    assert "".join(entry["function"]["arguments"] for entry in calls) == '{"city": "Oslo"}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_with_n_choices_each_parses_its_own_calls(tokenizer):
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER], "n": 2}
    request = parse_chat_request(json.dumps(body).encode(), ["m"], "hermes")
    params = fit_to_context(request, 3, 2048)
    choices = Generation.start_all(request, [1, 2, 3], params.stop, tokenizer)
    for _, update in feed_tokens(tokenizer, choices[1], OUTPUT):
        choices[1].feed(*update)
    for _, update in feed_tokens(tokenizer, choices[0], "Sunny, I think."):
        choices[0].feed(*update)
    first, second = response_body(choices)["choices"]
    assert (first["finish_reason"], first["message"]) == (
        "stop",
        {"role": "assistant", "content": "Sunny, I think."},
    )
    assert second["finish_reason"] == "tool_calls" and second["message"]["content"] == "Checking."
    assert second["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
