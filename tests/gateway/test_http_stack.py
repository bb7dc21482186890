"""The serving stack as plain processes, the topology compose.yaml runs: Redis, two executors, gateways, talked to
over real HTTP (the gateway tests' shared open_stack; the test that kills an executor starts a stack of its own)."""

from __future__ import annotations

import functools

import httpx
import pytest

from executor import LLM, SamplingParams
from shared import redis_keys as keys
from tests.gateway.answers import DONE, json_events, metric_samples, sse_events
from tests.processes import eventually
from tests.stacks import serving_stack

# the default 5 s is too short for a first request on a busy 2-core machine
post = functools.partial(httpx.post, timeout=60)


@pytest.fixture(scope="module")
def stack(open_stack):
    """(base url of gateway 1, executors, base url of gateway 2)."""
    return open_stack.gateways[0].base, open_stack.executors, open_stack.gateways[1].base


@pytest.fixture(scope="module")
def offline(tiny_models) -> LLM:
    return LLM(tiny_models["llama"], kv_cache_memory="8MiB")


def chat_body(content: str, **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "temperature": 0, **extra}


def test_completion_equals_the_offline_api_and_names_its_executor(stack, offline):
    base, executors, _ = stack
    response = post(
        f"{base}/v1/completions",
        json={"model": "tiny", "prompt": "hello world", "max_tokens": 8, "temperature": 0},
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-kvserve-executor"] in {e.id for e in executors}
    expected = offline.generate(["hello world"], SamplingParams(max_tokens=8, temperature=0))[0]
    body = response.json()
    assert body["choices"][0]["text"] == expected.outputs[0].text
    assert body["usage"]["completion_tokens"] == len(expected.outputs[0].token_ids)


def test_streaming_chat_is_framed_as_openai_and_matches_the_whole_answer(stack):
    base, _, _ = stack
    whole = post(f"{base}/v1/chat/completions", json=chat_body("Tell me about paging", max_tokens=12))
    assert whole.status_code == 200, whole.text
    streamed = post(
        f"{base}/v1/chat/completions",
        json=chat_body(
            "Tell me about paging", max_tokens=12, stream=True, stream_options={"include_usage": True}
        ),
    )
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = sse_events(streamed.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert (
        events[-1] == DONE and events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 12
    )
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2] if e["choices"])
    assert text == whole.json()["choices"][0]["message"]["content"]
    # the second identical prompt was routed to the executor holding its prefix
    assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert streamed.headers["x-kvserve-executor"] == whole.headers["x-kvserve-executor"]


@pytest.mark.parametrize(
    "path, body, status, code",
    [
        ("/v1/chat/completions", b"{not json", 400, None),
        (
            "/v1/chat/completions",
            {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
            404,
            "model_not_found",
        ),
        ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, None),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": -1},
            400,
            None,
        ),
        (
            "/v1/completions",
            {"model": "tiny", "prompt": "x", "max_tokens": 4096},
            400,
            "context_length_exceeded",
        ),
        (
            "/v1/completions",
            {"model": "tiny", "prompt": "x", "max_tokens": 10**6},  # over --max-request-completion-tokens
            400,
            None,
        ),
        (
            "/v1/completions",
            {"model": "tiny", "prompt": "x", "logit_bias": {str(10**7): 5}},  # refused by the executor
            400,
            None,
        ),
        (
            "/v1/chat/completions",
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "x"}],
                # refused by the executor's grammar compiler
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "no"}},
                },
            },
            400,
            None,
        ),
        ("/v1/nowhere", {}, 404, None),
    ],
)
def test_bad_requests_get_openai_errors(stack, path, body, status, code):
    base, _, _ = stack
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = post(f"{base}{path}", **kwargs)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["message"]
    assert error["code"] == code
    assert "x-kvserve-executor" in response.headers


def _running(executors) -> int:
    return sum(int(e.redis.hget(keys.load_key(e.id), "running") or 0) for e in executors)


def test_logit_bias_reaches_the_sampler(stack):
    base, _, _ = stack
    body = {
        "model": "tiny",
        "prompt": "x",
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
    }
    tokens = []
    for forced in ("42", "43"):
        response = post(f"{base}/v1/completions", json={**body, "logit_bias": {forced: 100}})
        assert response.status_code == 200
        tokens.append(response.json()["choices"][0]["logprobs"]["tokens"])
    assert all(len(run) == 5 and len(set(run)) == 1 for run in tokens)
    assert tokens[0][0] != tokens[1][0]


def test_stop_string_and_client_disconnect_free_the_executor(stack, offline):
    base, executors, _ = stack
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    text = offline.generate(["abc"], params)[0].outputs[0].text
    stop = text[6:10]
    response = post(
        f"{base}/v1/completions",
        json={
            "model": "tiny",
            "prompt": "abc",
            "max_tokens": 40,
            "temperature": 0,
            "ignore_eos": True,
            "stop": [stop],
        },
    )
    choice = response.json()["choices"][0]
    assert choice["text"] == text[: text.index(stop)] and choice["finish_reason"] == "stop"
    # a streaming client that leaves after the first event: its request must be aborted, not run on
    with httpx.stream(
        "POST",
        f"{base}/v1/completions",
        json={"model": "tiny", "prompt": "abc", "max_tokens": 2000, "ignore_eos": True, "stream": True},
    ) as streaming:
        next(streaming.iter_lines())
    assert eventually(lambda: _running(executors) == 0, timeout=10)
    # and its blocks are back in the pool
    assert all(float(e.redis.hget(keys.load_key(e.id), "kv_usage")) == 0 for e in executors)


def test_health_models_and_metrics(stack):
    base, executors, _ = stack
    assert sorted(httpx.get(f"{base}/health").json()["executors"]) == sorted(e.id for e in executors)
    assert httpx.get(f"{base}/v1/models").json()["data"][0]["id"] == "tiny"
    before = metric_samples(f"{base}/metrics")
    body = {"model": "tiny", "prompt": "count", "max_tokens": 3, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body) as response:
        lines = list(response.iter_lines())
        assert response.status_code == 200 and "data: [DONE]" in lines
    usage = list(json_events(lines))[-1]["usage"]
    # counted in flight from routing to its first update, then no longer
    assert eventually(lambda: all(int(e.redis.get(keys.inflight_key(e.id)) or 0) == 0 for e in executors))

    def moved(name: str, labels: tuple = ()) -> float:
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    def moved_on_executors(name: str) -> float:
        return sum(moved(name, (("executor", e.id),)) for e in executors)

    def executor_stats_published() -> bool:
        nonlocal after
        after = metric_samples(f"{base}/metrics")
        return moved_on_executors("kvserve_queue_time_seconds_count") == 1

    after = {}
    assert eventually(
        executor_stats_published, timeout=5
    )  # executors publish their stats about once a second
    no_adapter, tenant = ("adapter", ""), ("tenant", "anonymous")  # the base model, not a LoRA adapter
    labels = (no_adapter, ("endpoint", "completion"), ("status", "200"), tenant)
    assert moved("kvserve_requests_total", labels) == 1
    assert moved("kvserve_prompt_tokens_total", (no_adapter, tenant)) == usage["prompt_tokens"]
    assert moved("kvserve_generation_tokens_total", (no_adapter, tenant)) == 3
    assert moved("kvserve_inter_token_latency_seconds_count") == 2  # the gaps between 3 tokens
    assert moved("kvserve_e2e_request_latency_seconds_count") == 1
    assert moved("kvserve_time_to_first_token_seconds_count") == 1
    routed = sum(
        moved("kvserve_route_decisions_total", (("policy", "cache_aware"), ("reason", reason)))
        for reason in ("prefix_hit", "least_loaded")
    )
    assert routed == 1
    assert moved_on_executors("kvserve_prefix_cache_queried_tokens_total") == usage["prompt_tokens"]
    for e in executors:
        assert after[("kvserve_kv_blocks_total", (("executor", e.id),))] > 0
        assert after[("kvserve_kv_blocks_used", (("executor", e.id),))] == 0
        assert after[("kvserve_running_requests", (("executor", e.id),))] == 0
    # the gateway's own share of time to first token is counted, and never exceeds the whole
    added = "kvserve_gateway_added_latency_seconds"
    assert moved(f"{added}_count") == 1
    assert 0 <= moved(f"{added}_sum") <= moved("kvserve_time_to_first_token_seconds_sum")


def test_the_openai_client_gets_the_offline_answer(stack, offline):
    import openai

    base, _, _ = stack
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    chunks = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    prompt = offline.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    expected = offline.generate([prompt], SamplingParams(max_tokens=10, temperature=0))[0].outputs[0].text
    assert whole.choices[0].message.content == streamed == expected
    completion = client.completions.create(model="tiny", prompt="hello world", max_tokens=8, temperature=0)
    assert (
        completion.choices[0].text
        == offline.generate(["hello world"], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text
    )


def _complete(base: str, prompt: list[int]) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    response = post(f"{base}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response


def test_prefix_families_return_to_the_executor_holding_them_through_either_gateway(stack):
    base, _, other_base = stack
    families = {name: list(range(start, start + 96)) for name, start in (("a", 3000), ("b", 7000))}
    home = {}
    for name, prefix in families.items():
        home[name] = _complete(base, prefix + [1]).headers["x-kvserve-executor"]
    for i in range(3):
        for name, prefix in families.items():
            for url in (base, other_base):
                response = _complete(url, prefix + [10 + i])
                assert response.headers["x-kvserve-executor"] == home[name]
                assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 96


def test_a_killed_executor_is_routed_around_and_its_entries_expire(tiny_models, tmp_path):
    with serving_stack(tiny_models["llama"], tmp_path, executors=2) as own:  # it kills an executor
        base, executors = own.base, own.executors
        prefix = list(range(9000, 9064))
        victim_id = _complete(base, prefix + [1]).headers["x-kvserve-executor"]
        victim = next(e for e in executors if e.id == victim_id)
        survivor = next(e for e in executors if e.id != victim_id)
        victim.process.kill()
        victim.process.wait()
        # routed to the dead one first (its prefix, its heartbeat not yet expired), then retried on the survivor
        response = _complete(base, prefix + [2])
        assert response.headers["x-kvserve-executor"] == survivor.id
        streamed = post(
            f"{base}/v1/completions",
            json={"model": "tiny", "prompt": prefix + [3], "max_tokens": 3, "stream": True},
            timeout=60,
        )
        assert sse_events(streamed.text)[-1] == DONE
        gone = [keys.executor_key(victim_id), keys.blocks_key(victim_id), keys.load_key(victim_id)]
        assert eventually(lambda: not any(survivor.redis.exists(k) for k in gone), timeout=10)
        assert httpx.get(f"{base}/health").json()["executors"] == [survivor.id]
