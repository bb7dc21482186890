"""echo and prompt_logprobs over HTTP, on a real stack (the shared open_stack): the prompt's text exactly
as sent, offsets into it, and the engine's prompt logprobs (which tests/executor/test_prompt_logprobs.py holds to
HF's) as OpenAI's legacy columns and as vLLM's list."""

from __future__ import annotations

import functools
import json

import httpx
import pytest

from executor import LLM, SamplingParams
from tests.gateway.answers import DONE, sse_events
from tests.gateway.test_http_stack import chat_body

post = functools.partial(httpx.post, timeout=60)

# multi-byte UTF-8 (2, 3 and 4 bytes), some of it split across byte-level tokens
PROMPT = "Grüße aus Köln — 日本語のテキスト 🚀 and plain words after it."


@pytest.fixture(scope="module")
def stack(open_stack) -> str:
    return open_stack.base


@pytest.fixture(scope="module")
def offline(tiny_models):
    """The engine's own prompt logprobs for PROMPT (top 3), and its tokens."""
    llm = LLM(tiny_models["llama"], kv_cache_memory="8MiB")
    out = llm.generate([PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=3))[0]
    return out.prompt_token_ids, out.prompt_logprobs, llm.tokenizer


def complete(base: str, **body) -> dict:
    response = post(f"{base}/v1/completions", json={"model": "tiny", "prompt": PROMPT, **body})
    assert response.status_code == 200, response.text
    return response.json()


def check_offsets(text: str, tokens: list[str], offsets: list[int], token_bytes: list[bytes]) -> None:
    """Each offset counts the characters the tokens before it completed; a whole-character token's text starts
    there."""
    seen = b""
    for token, offset, raw in zip(tokens, offsets, token_bytes, strict=True):
        assert offset == len(seen.decode(errors="ignore"))
        if not token.startswith("bytes:"):
            assert text[offset:].startswith(token)
        seen += raw


def test_echo_with_max_tokens_zero_scores_the_prompt(stack, offline):
    ids, entries, tokenizer = offline
    body = complete(stack, echo=True, logprobs=3, max_tokens=0)
    choice = body["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)
    columns = choice["logprobs"]
    assert columns["token_logprobs"][0] is None and columns["top_logprobs"][0] is None
    assert len(columns["tokens"]) == len(ids)
    for got, want in zip(columns["token_logprobs"][1:], entries[1:], strict=True):
        assert abs(got - want.logprob) < 1e-5
    for got, want in zip(columns["top_logprobs"][1:], entries[1:], strict=True):
        assert len(got) <= 3 and max(got.values()) == pytest.approx(want.top[0][1], abs=1e-5)
    from gateway.openai.logprobs import LogprobFormatter

    token_bytes = [LogprobFormatter(tokenizer).token_bytes(t) for t in ids]
    assert b"".join(token_bytes) == PROMPT.encode()
    check_offsets(PROMPT, columns["tokens"], columns["text_offset"], token_bytes)


def test_echo_then_the_completion(stack, offline):
    ids = offline[0]
    body = complete(stack, echo=True, logprobs=1, max_tokens=4, temperature=0, ignore_eos=True)
    plain = complete(stack, max_tokens=4, temperature=0, ignore_eos=True, logprobs=1)
    choice = body["choices"][0]
    completion = plain["choices"][0]["text"]
    assert choice["text"] == PROMPT + completion
    columns = choice["logprobs"]
    assert len(columns["tokens"]) == len(ids) + 4
    assert columns["tokens"][len(ids) :] == plain["choices"][0]["logprobs"]["tokens"]
    shifted = [offset + len(PROMPT) for offset in plain["choices"][0]["logprobs"]["text_offset"]]
    assert columns["text_offset"][len(ids) :] == shifted
    # what lm-evaluation-harness reads: every token after the context has a logprob and a top entry
    assert all(isinstance(lp, float) for lp in columns["token_logprobs"][1:])
    assert all(len(top) == 1 for top in columns["top_logprobs"][1:])


def test_echo_without_logprobs_and_the_prompt_first_when_streaming(stack):
    assert complete(stack, echo=True, max_tokens=0)["choices"][0]["text"] == PROMPT
    response = post(
        f"{stack}/v1/completions",
        json={"model": "tiny", "prompt": PROMPT, "echo": True, "max_tokens": 3, "stream": True},
    )
    events = sse_events(response.text)
    assert events[0]["choices"][0]["text"] == PROMPT
    assert events[-1] == DONE
    streamed = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert streamed.startswith(PROMPT) and len(streamed) > len(PROMPT)


def test_vllm_prompt_logprobs_on_completions_and_chat(stack, offline):
    ids, entries, _ = offline
    choice = complete(stack, prompt_logprobs=2, max_tokens=1)["choices"][0]
    assert choice["text"] != PROMPT  # no echo: the text is the completion only
    listed = choice["prompt_logprobs"]
    assert len(listed) == len(ids) and listed[0] is None
    for position, (token_id, entry, want) in enumerate(zip(ids[1:], listed[1:], entries[1:], strict=True)):
        assert abs(entry[str(token_id)]["logprob"] - want.logprob) < 1e-5, position
        assert entry[str(token_id)]["rank"] == want.rank
        assert len(entry) <= 3
    response = post(
        f"{stack}/v1/chat/completions", json=chat_body("Hi there", prompt_logprobs=0, max_tokens=2)
    )
    assert response.status_code == 200, response.text
    body = response.json()
    listed = body["prompt_logprobs"]
    assert len(listed) == body["usage"]["prompt_tokens"] and listed[0] is None
    assert all(len(entry) == 1 for entry in listed[1:])  # the prompt token itself, no top entries


@pytest.mark.parametrize(
    "path, body, param, message",
    [
        ("completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs", "in [0, 20]"),
        ("completions", {"prompt": "x", "prompt_logprobs": "2"}, "prompt_logprobs", "must be an integer"),
        ("completions", {"prompt": "x", "echo": "yes"}, "echo", "echo must be a boolean"),
        ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", "at least 1"),
        ("completions", {"prompt": "x", "echo": True, "logprobs": 21}, "logprobs", "in [0, 20]"),
        ("chat/completions", {**chat_body("x"), "echo": True}, "echo", "/v1/completions only"),
        ("chat/completions", {**chat_body("x"), "prompt_logprobs": -1}, "prompt_logprobs", "in [0, 20]"),
    ],
)
def test_bad_values_are_400_naming_the_field(stack, path, body, param, message):
    response = post(f"{stack}/v1/{path}", json={"model": "tiny", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_the_lm_eval_harness_request(stack, offline):
    """local-completions' loglikelihood request, as lm-eval 0.4 sends it: a batch of one token-id prompt."""
    ids, entries, _ = offline
    payload = {"prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    response = post(f"{stack}/v1/completions", content=json.dumps({"model": "tiny", **payload}))
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    context = 5
    scored = choice["logprobs"]["token_logprobs"][context:-1]
    assert scored == pytest.approx([e.logprob for e in entries[context:]], abs=1e-5)
