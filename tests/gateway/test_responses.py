from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from gateway.openai.request import fit_to_context, parse_chat_request, parse_completion_request
from gateway.openai.responses import DONE_EVENT, EventStream, Generation, response_body

MODELS = ("m",)
HELLO, THERE, BANG = 19556, 665, 17  # "Hello", " there", "!" in the default model's vocabulary


@dataclass
class Logprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int = 1


def generation(tokenizer, endpoint: str = "chat", prompt_ids=(1, 2, 3), **fields) -> Generation:
    body = {"messages": [{"role": "user", "content": "x"}]} if endpoint == "chat" else {"prompt": "x"}
    parse = parse_chat_request if endpoint == "chat" else parse_completion_request
    request = parse(json.dumps(body | fields).encode(), MODELS)
    params = fit_to_context(request, len(prompt_ids), 2048)
    gen = Generation.start(request, list(prompt_ids), params.stop, tokenizer)
    gen.id, gen.created = "id-1", 1700000000  # fixed, so the events can be compared byte for byte
    return gen


def events(text: str) -> list[str]:
    assert text.endswith("\n\n")
    return [e + "\n\n" for e in text.split("\n\n")[:-1]]


def test_chat_stream_is_byte_exact(tokenizer):
    stream = EventStream(generation(tokenizer, stream=True), include_usage=False)
    out = stream.update([HELLO], None, None, 2) + stream.update([THERE, BANG], None, "stop", 2)
    head = '{"id":"id-1","object":"chat.completion.chunk","created":1700000000,"model":"m","choices":'
    assert out == (
        f'data: {head}[{{"index":0,"delta":{{"role":"assistant","content":""}},"logprobs":null,"finish_reason":null}}]}}\n\n'
        f'data: {head}[{{"index":0,"delta":{{"content":"Hello"}},"logprobs":null,"finish_reason":null}}]}}\n\n'
        f'data: {head}[{{"index":0,"delta":{{"content":" there!"}},"logprobs":null,"finish_reason":null}}]}}\n\n'
        f'data: {head}[{{"index":0,"delta":{{}},"logprobs":null,"finish_reason":"stop"}}]}}\n\n'
        "data: [DONE]\n\n"
    )
    assert stream.update([HELLO], None, None, 2) == ""  # nothing after [DONE]


def test_chat_stream_with_usage(tokenizer):
    gen = generation(tokenizer, prompt_ids=range(7), stream=True, stream_options={"include_usage": True})
    stream = EventStream(gen, include_usage=True)
    out = events(stream.update([HELLO], None, None, 0) + stream.update([THERE], None, "length", 4))
    payloads = [json.loads(e[len("data: ") :]) for e in out[:-1]]
    assert out[-1] == DONE_EVENT
    assert [p["usage"] for p in payloads[:-1]] == [None] * 4  # OpenAI: usage null on every chunk...
    assert payloads[-1]["choices"] == []  # ...and one last chunk with no choices carries it
    assert payloads[-1]["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 2,
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"


def test_cached_tokens_keep_their_split_by_source_which_usage_does_not_show(tokenizer):
    gen = generation(tokenizer, prompt_ids=range(80), stream=True, stream_options={"include_usage": True})
    stream = EventStream(gen, include_usage=True)
    text = stream.update([HELLO], None, None, 64, cached_from={"disk": 48})
    text += stream.update([THERE], None, "length", 64, cached_from={"disk": 48})
    payloads = [json.loads(e[len("data: ") :]) for e in events(text)[:-1]]
    # OpenAI's usage object as ever: cached_tokens counts every source, and nothing non-standard is added
    assert payloads[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 64}
    assert (gen.cached_tokens, gen.cached_from) == (64, {"disk": 48})  # what the tenant's usage splits
    gen.feed([BANG], None, "stop", 16)  # after its end an update changes nothing
    assert (gen.cached_tokens, gen.cached_from) == (64, {"disk": 48})


def test_completion_stream_is_byte_exact(tokenizer):
    stream = EventStream(generation(tokenizer, "completion", stream=True), include_usage=False)
    out = stream.update([HELLO], None, None, 0) + stream.update([BANG], None, "length", 0)
    head = '{"id":"id-1","object":"text_completion","created":1700000000,"model":"m","choices":'
    assert out == (
        f'data: {head}[{{"text":"Hello","index":0,"logprobs":null,"finish_reason":null}}]}}\n\n'
        f'data: {head}[{{"text":"!","index":0,"logprobs":null,"finish_reason":null}}]}}\n\n'
        f'data: {head}[{{"text":"","index":0,"logprobs":null,"finish_reason":"length"}}]}}\n\n'
        "data: [DONE]\n\n"
    )


def test_stream_ends_at_a_stop_string_and_asks_for_an_abort(tokenizer):
    gen = generation(tokenizer, stream=True, stop=["ere"])
    stream = EventStream(gen, include_usage=False)
    first = stream.update([HELLO], None, None, 0)
    assert not gen.stop_matched and '"content":"Hello"' in first
    second = events(stream.update([THERE], None, None, 0))  # the executor has not finished
    assert gen.stop_matched and gen.finish_reason == "stop"
    assert [json.loads(e[6:])["choices"][0]["delta"] for e in second[:-1]] == [{"content": " th"}, {}]
    assert second[-1] == DONE_EVENT
    assert stream.update([BANG], None, "length", 0) == ""  # late tokens from before the abort are dropped
    assert response_body(gen)["choices"][0]["message"]["content"] == "Hello th"


def test_multibyte_stream_never_sends_a_broken_character(tokenizer):
    text = "😀 日本語"
    stream = EventStream(generation(tokenizer, stream=True), include_usage=False)
    ids = tokenizer.encode(text)
    out = "".join(
        stream.update([t], None, "stop" if i == len(ids) - 1 else None, 0) for i, t in enumerate(ids)
    )
    deltas = [json.loads(e[6:])["choices"][0]["delta"].get("content", "") for e in events(out)[:-1]]
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    assert len(deltas) < len(ids) + 2  # partial characters were merged, not sent as empty chunks


def test_non_streaming_chat_completion(tokenizer):
    gen = generation(tokenizer, prompt_ids=range(5))
    gen.feed([HELLO], None, None, 3)
    gen.feed([THERE], None, "stop", 3)
    body = response_body(gen)
    assert body == {
        "id": "id-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello there"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": 5,
            "completion_tokens": 2,
            "total_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 3},
        },
    }


def test_non_streaming_text_completion(tokenizer):
    gen = generation(tokenizer, "completion")
    gen.feed([HELLO, THERE], None, "length", 0)
    body = response_body(gen)
    assert body["object"] == "text_completion"
    assert body["choices"] == [
        {"index": 0, "text": "Hello there", "logprobs": None, "finish_reason": "length"}
    ]
    assert body["id"] == "id-1" and body["usage"]["completion_tokens"] == 2


def test_ids_name_the_endpoint(tokenizer):
    request = parse_chat_request(
        json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), MODELS
    )
    gen = Generation.start(request, [1], [], tokenizer)
    assert gen.id.startswith("chatcmpl-") and gen.created > 1700000000


def test_chat_logprobs_streamed_with_their_text(tokenizer):
    gen = generation(tokenizer, stream=True, logprobs=True, top_logprobs=1, stop=["Hello!"])
    stream = EventStream(gen, include_usage=False)
    # "Hello" is held back (it could be the start of "Hello!"), so its logprob waits for it too
    held = events(stream.update([HELLO], [Logprob(HELLO, -0.5, [(HELLO, -0.5)])], None, 0))
    assert len(held) == 1  # only the role chunk
    out = events(stream.update([THERE], [Logprob(THERE, -1.0, [(BANG, -0.2)])], "stop", 0))
    chunk = json.loads(out[0][6:])["choices"][0]
    assert chunk["delta"] == {"content": "Hello there"}
    assert chunk["logprobs"] == {
        "content": [
            {
                "token": "Hello",
                "logprob": -0.5,
                "bytes": list(b"Hello"),
                "top_logprobs": [{"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello")}],
            },
            {
                "token": " there",
                "logprob": -1.0,
                "bytes": list(b" there"),
                "top_logprobs": [{"token": "!", "logprob": -0.2, "bytes": [33]}],
            },
        ]
    }
    assert json.loads(out[1][6:])["choices"][0]["logprobs"] is None
    assert response_body(gen)["choices"][0]["logprobs"] == chunk["logprobs"]


@pytest.mark.parametrize("stream", [True, False])
def test_completion_logprobs_columns(tokenizer, stream):
    gen = generation(tokenizer, "completion", logprobs=1, stream=stream)
    updates = [
        ([HELLO], [Logprob(HELLO, -0.1, [(HELLO, -0.1)])]),
        ([THERE], [Logprob(THERE, -0.3, [(BANG, -0.2)])]),
    ]
    if stream:
        s = EventStream(gen, include_usage=False)
        out = [s.update(ids, lps, "length" if i else None, 0) for i, (ids, lps) in enumerate(updates)]
        logprobs = [json.loads(events(o)[0][6:])["choices"][0]["logprobs"] for o in out]
        assert [lp["text_offset"] for lp in logprobs] == [[0], [5]]
    else:
        for i, (ids, lps) in enumerate(updates):
            gen.feed(ids, lps, "length" if i else None, 0)
        assert response_body(gen)["choices"][0]["logprobs"] == {
            "tokens": ["Hello", " there"],
            "token_logprobs": [-0.1, -0.3],
            "top_logprobs": [{"Hello": -0.1}, {"!": -0.2}],
            "text_offset": [0, 5],
        }


def test_wire_logprobs_and_offsets_across_split_characters(tokenizer):
    """The executor's wire entries are [token_id, logprob, rank, [[id, logprob], ...]]."""
    gen = generation(tokenizer, "completion", logprobs=0)
    ids = tokenizer.encode("😀a")  # several byte tokens, then "a"
    gen.feed(ids, [[t, -1.0, 1, []] for t in ids], "length", 0)
    logprobs = response_body(gen)["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"] == [-1.0] * len(ids)
    assert logprobs["text_offset"] == [0] * (len(ids) - 1) + [1]  # "a" starts after the one emoji character
    assert logprobs["top_logprobs"] == [{}] * len(ids)


@pytest.mark.parametrize("stream", [True, False])
def test_echo_puts_the_prompt_and_its_columns_first(tokenizer, stream):
    """Streamed or whole, the same columns: the prompt's (its first token without logprob or top), then the
    output's, offsets running on from the prompt's text."""
    prompt = "Köln 日本"
    ids = tokenizer.encode(prompt)
    gen = generation(tokenizer, "completion", ids, prompt=prompt, echo=True, logprobs=1, stream=stream)
    scored = [[t, -1.5, 2, [[HELLO, -0.5], [BANG, -0.7]]] for t in ids[1:]]  # top 2 computed, 1 shown
    update = ([HELLO], [Logprob(HELLO, -0.1, [(HELLO, -0.1)])], "length", 0, scored)
    if stream:
        out = events(EventStream(gen, include_usage=False).update(*update[:4], prompt_logprobs=update[4]))
        choices = [json.loads(e[6:])["choices"][0] for e in out[:-1]]
        assert choices[0]["text"] == prompt and choices[1]["text"] == "Hello"  # the prompt comes first
        columns = choices[0]["logprobs"]
        assert choices[1]["logprobs"]["text_offset"] == [len(prompt)]
    else:
        gen.feed(*update)
        choice = response_body(gen)["choices"][0]
        assert choice["text"] == prompt + "Hello"
        columns = choice["logprobs"]
        assert columns["text_offset"][-1] == len(prompt) and columns["token_logprobs"][-1] == -0.1
    n = len(ids)
    assert columns["token_logprobs"][:n] == [None] + [-1.5] * (n - 1)
    assert columns["top_logprobs"][:n] == [None] + [{"Hello": -0.5}] * (n - 1)
    assert columns["text_offset"][0] == 0 and columns["text_offset"][n - 1] < len(prompt)
    assert "prompt_logprobs" not in choices[0] if stream else "prompt_logprobs" not in choice


def test_n_choices_stream_with_their_index_each_ends_on_its_own_and_usage_counts_the_prompt_once(tokenizer):
    body = {"messages": [{"role": "user", "content": "x"}], "n": 2, "stream": True}
    body["stream_options"] = {"include_usage": True}
    request = parse_chat_request(json.dumps(body).encode(), MODELS)
    params = fit_to_context(request, 5, 2048)
    choices = Generation.start_all(request, [1, 2, 3, 4, 5], params.stop, tokenizer)
    assert [c.index for c in choices] == [0, 1] and len({(c.id, c.created) for c in choices}) == 1
    stream = EventStream(choices, include_usage=True)
    out = events(
        stream.update([HELLO], None, None, 0, index=1) + stream.update([THERE], None, "length", 0, index=1)
    )
    payloads = [json.loads(e[len("data: ") :]) for e in out]
    assert [(p["choices"][0]["index"], p["choices"][0]["finish_reason"]) for p in payloads] == [
        (1, None),  # its role chunk
        (1, None),
        (1, None),
        (1, "length"),
    ]
    assert DONE_EVENT not in out  # choice 0 is still going
    out = events(stream.update([BANG], None, "stop", 0, index=0))
    assert out[-1] == DONE_EVENT and stream.finished
    usage = json.loads(out[-2][len("data: ") :])["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (5, 3)
    whole = response_body(choices)
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in whole["choices"]] == [
        (0, "!", "stop"),
        (1, "Hello there", "length"),
    ]
    assert whole["usage"]["total_tokens"] == 8
