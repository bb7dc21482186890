"""One tenant's hostile requests against another's plain one, over real HTTP with two keys (issue: tenants isolated).

Each hostile input from the issue is sent by alpha while beta's plain streaming chat runs beside it: alpha gets its
own bounded answer (a 400 naming the field, a 401 without a key, or its grammar's deadline) and beta's request ends
within a small bound of its time alone. bench/tenancy/hostile_inputs.py measures the same on the default model."""

from __future__ import annotations

import concurrent.futures
import json
import statistics
import time

import httpx
import pytest

from tests.gateway.answers import openai_error
from tests.stacks import serving_stack

VOCAB = 49152  # the default model's tokenizer, which the tiny models share
EVIL_REGEX = "".join(f"[^{chr(97 + i % 26)}]*" for i in range(160))  # 800 bytes; compiles in seconds
COMPILE_TIMEOUT_S = 3  # the executor's --grammar-compile-timeout: the regex above runs out of it
BIG_BODY = (
    b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"a " * (2 * 1024 * 1024 - 64) + b'"}]}'
)


@pytest.fixture(scope="module")
def tenants(tiny_models, tmp_path_factory):
    """(gateway base url, alpha's key, beta's key) over a stack of their own: its executor's compile deadline is
    short, and beta's times are measured against an otherwise idle executor."""
    timeout = ("--grammar-compile-timeout", str(COMPILE_TIMEOUT_S))
    logs = tmp_path_factory.mktemp("hostile-logs")
    with serving_stack(
        tiny_models["llama"], logs, executor_flags=timeout, tenants=("alpha", "beta")
    ) as stack:
        yield stack.base, stack.keys["alpha"], stack.keys["beta"]


def _headers(key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"} if key else {}


def _chat(base: str, key: str | None, timeout: float = 120, **body) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}], **body}
    return httpx.post(f"{base}/v1/chat/completions", json=body, headers=_headers(key), timeout=timeout)


def _victim(base: str, key: str) -> float:
    """Seconds for beta's plain streamed chat of 32 tokens."""
    started = time.monotonic()
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "max_tokens": 32,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{base}/v1/chat/completions", json=body, headers=_headers(key), timeout=120
    ) as response:
        assert response.status_code == 200
        text = "".join(response.iter_text())
    assert text.rstrip().endswith("data: [DONE]")
    return time.monotonic() - started


@pytest.fixture(scope="module")
def alone(tenants) -> float:
    base, _, beta = tenants
    _victim(base, beta)  # warm
    return statistics.median(_victim(base, beta) for _ in range(3))


def _beside(tenants, alone: float, attack, bound: float | None = None) -> list:
    """Run attack() (a list of callables, alpha's requests) concurrently; beta's request starts once they are
    under way and must end within bound (default: a small bound of its time alone). The attack's results."""
    base, _, beta = tenants
    with concurrent.futures.ThreadPoolExecutor(len(attack) + 1) as pool:
        sent = [pool.submit(call) for call in attack]
        time.sleep(0.3)
        victim = _victim(base, beta)
        results = [future.result(timeout=120) for future in sent]
    bound = 4 * alone + 3 if bound is None else bound
    assert victim < bound, f"beta took {victim:.2f} s beside the attack, {alone:.2f} s alone"
    return results


def _refused(response: httpx.Response, status: int, param: str | None) -> str:
    error = openai_error(response, status)
    assert error["param"] == param
    return error["message"]


def test_logit_bias_over_the_whole_vocabulary(tenants, alone):
    base, alpha, _ = tenants
    bias = {str(t): 1 for t in range(VOCAB)}
    (response,) = _beside(tenants, alone, [lambda: _chat(base, alpha, logit_bias=bias, max_tokens=64)])
    assert "--max-logit-bias" in _refused(response, 400, "logit_bias")


def test_a_flood_of_stop_strings_with_many_choices(tenants, alone):
    base, alpha, _ = tenants
    stops = [f"s{i:06d}" for i in range(200_000)]
    (response,) = _beside(tenants, alone, [lambda: _chat(base, alpha, stop=stops, n=32, max_tokens=64)])
    assert "--max-stop-strings" in _refused(response, 400, "stop")


def test_a_regex_that_compiles_for_seconds(tenants, alone):
    """Under the gateway's size cap, so it reaches the executor: its compile runs out of its deadline there, in a
    worker of its own, and alpha is told so. Beta never waits for it: sixteen such requests (the executor's
    --max-waiting-seqs) wait for their grammar outside the waiting queue, so its places stay free."""
    base, alpha, _ = tenants
    constrained = {"structured_outputs": {"regex": EVIL_REGEX}, "max_tokens": 8}
    attack = [lambda: _chat(base, alpha, **constrained) for _ in range(16)]
    responses = _beside(tenants, alone, attack, bound=min(4 * alone + 3, COMPILE_TIMEOUT_S - 0.5))
    for response in responses:
        assert "--grammar-compile-timeout" in _refused(response, 400, "structured_outputs.regex")
    # the worker that was killed is replaced: a grammar compiles afterwards
    plain = _chat(base, alpha, structured_outputs={"regex": "(yes|no)"}, max_tokens=8, temperature=0)
    assert plain.status_code == 200 and plain.json()["choices"][0]["message"]["content"] in ("yes", "no")


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def test_a_flood_of_slow_patterns_leaves_another_tenants_schema_to_the_fast_lane(tenants):
    """Alpha's schemas, whose string pattern has 156 overlapping classes, outgrow the fast lane's budget and run
    out of the slow lane's deadline; beta's plain schema, sent while they compile, is answered before any of
    them is refused (it never waits for a slow compile), and alpha's schema sent again is refused at once, with
    the same message: no compile can be refused for its deadline before the deadline has passed."""
    base, alpha, beta = tenants
    pattern = "^" + EVIL_REGEX[: 156 * 5] + "$"
    flood = _json_schema({"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}})
    plain = _json_schema({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})

    def timed(key: str, **body) -> tuple[httpx.Response, float]:
        response = _chat(base, key, max_tokens=16, temperature=0, **body)
        return response, time.monotonic()

    with concurrent.futures.ThreadPoolExecutor(17) as pool:
        attack = [pool.submit(timed, alpha, response_format=flood) for _ in range(16)]
        time.sleep(0.3)
        victim, answered = timed(beta, response_format=plain)
        refusals = [future.result(timeout=120) for future in attack]
    assert victim.status_code == 200, victim.text
    choice = victim.json()["choices"][0]
    assert choice["finish_reason"] == "length" or isinstance(
        json.loads(choice["message"]["content"])["ok"], bool
    )
    messages = {_refused(response, 400, "response_format.json_schema.schema") for response, _ in refusals}
    (message,) = messages
    assert "--grammar-compile-timeout" in message
    assert answered < min(refused_at for _, refused_at in refusals)
    started = time.monotonic()
    again, _ = timed(alpha, response_format=flood)
    assert time.monotonic() - started < COMPILE_TIMEOUT_S
    assert _refused(again, 400, "response_format.json_schema.schema") == message


def test_keyless_bodies_cost_the_gateway_little(tenants, alone):
    base, _, _ = tenants

    def keyless() -> httpx.Response:
        return httpx.post(
            f"{base}/v1/chat/completions",
            content=BIG_BODY,
            headers={"content-type": "application/json"},
            timeout=120,
        )

    responses = _beside(tenants, alone, [keyless for _ in range(8)])
    for response in responses:
        _refused(response, 401, None)
    started = time.monotonic()
    assert httpx.get(f"{base}/health/live", timeout=30).status_code == 200
    assert time.monotonic() - started < 2


def test_many_choices_with_top_logprobs(tenants, alone):
    """Within the limits it is served, at a bounded cost; one step past them it is refused."""
    base, alpha, _ = tenants
    wide = {"n": 32, "logprobs": True, "top_logprobs": 20, "ignore_eos": True}
    (response,) = _beside(tenants, alone, [lambda: _chat(base, alpha, max_tokens=128, **wide)])
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == 32 and all(len(c["logprobs"]["content"]) == 128 for c in choices)
    assert "--max-request-logprobs" in _refused(_chat(base, alpha, max_tokens=512, **wide), 400, "max_tokens")


def test_huge_tools_and_message_lists(tenants, alone):
    base, alpha, _ = tenants
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20)}}
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": schema}} for i in range(2000)]
    messages = [{"role": "user", "content": "hi"}] * 20_000
    results = _beside(
        tenants,
        alone,
        [
            lambda: _chat(base, alpha, tools=tools, tool_choice="required", max_tokens=8),
            lambda: _chat(base, alpha, messages=messages, max_tokens=8),
        ],
    )
    assert "--max-tools" in _refused(results[0], 400, "tools")
    assert "--max-messages" in _refused(results[1], 400, "messages")
