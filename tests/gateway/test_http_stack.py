"""The serving stack as plain processes, the topology compose.yaml runs: Redis, two executors, one gateway,
talked to over real HTTP."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from executor import LLM, SamplingParams
from shared import redis_keys as keys
from shared.redis_server import start_redis_server
from tests.processes import REPO, ExecutorProcess, eventually, free_port


@pytest.fixture(scope="module")
def stack(tiny_models, tmp_path_factory):
    """(base url, executors) with a Redis of its own, so no other test's executors are seen."""
    logs = tmp_path_factory.mktemp("stack-logs")
    server = start_redis_server()
    model = tiny_models["llama"]
    executors = [ExecutorProcess(model, server.url, logs / f"executor-{i}.log") for i in range(2)]
    port = free_port()
    args = [sys.executable, "-m", "executor.cli", "gateway", "--model", model, "--served-model-name", "tiny"]
    args += ["--redis-url", server.url, "--port", str(port)]
    gateway_log = open(logs / "gateway.log", "wb")  # noqa: SIM115 - closed below
    gateway = subprocess.Popen(args, cwd=REPO, stdout=gateway_log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        for executor in executors:
            executor.wait_registered()

        def healthy() -> bool:
            try:
                return httpx.get(f"{base}/health").status_code == 200
            except httpx.HTTPError:
                return False

        assert eventually(healthy, timeout=60), (logs / "gateway.log").read_text()
        yield base, executors
    finally:
        gateway.terminate()
        gateway.wait(15)
        gateway_log.close()
        for executor in executors:
            executor.stop()
        server.stop()


@pytest.fixture(scope="module")
def offline(tiny_models) -> LLM:
    return LLM(tiny_models["llama"], kv_cache_memory="8MiB")


def chat_body(content: str, **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "temperature": 0, **extra}


def sse_events(response: httpx.Response) -> list:
    events = []
    for block in response.text.split("\n\n"):
        if block:
            assert block.startswith("data: ")
            payload = block[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_completion_equals_the_offline_api_and_names_its_executor(stack, offline):
    base, executors = stack
    response = httpx.post(
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
    base, _ = stack
    whole = httpx.post(f"{base}/v1/chat/completions", json=chat_body("Tell me about paging", max_tokens=12))
    assert whole.status_code == 200, whole.text
    streamed = httpx.post(
        f"{base}/v1/chat/completions",
        json=chat_body(
            "Tell me about paging", max_tokens=12, stream=True, stream_options={"include_usage": True}
        ),
    )
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = sse_events(streamed)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert (
        events[-1] == "[DONE]"
        and events[-2]["choices"] == []
        and events[-2]["usage"]["completion_tokens"] == 12
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
            {"model": "tiny", "prompt": "x", "max_tokens": 10**6},
            400,
            "context_length_exceeded",
        ),
        ("/v1/nowhere", {}, 404, None),
    ],
)
def test_bad_requests_get_openai_errors(stack, path, body, status, code):
    base, _ = stack
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(f"{base}{path}", **kwargs)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["message"]
    assert error["code"] == code
    assert "x-kvserve-executor" in response.headers


def _running(executors) -> int:
    return sum(int(e.redis.hget(keys.load_key(e.id), "running") or 0) for e in executors)


def test_stop_string_and_client_disconnect_free_the_executor(stack, offline):
    base, executors = stack
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    text = offline.generate(["abc"], params)[0].outputs[0].text
    stop = text[6:10]
    response = httpx.post(
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


def test_health_models_and_metrics(stack):
    base, executors = stack
    assert sorted(httpx.get(f"{base}/health").json()["executors"]) == sorted(e.id for e in executors)
    assert httpx.get(f"{base}/v1/models").json()["data"][0]["id"] == "tiny"
    metrics = httpx.get(f"{base}/metrics").text
    assert 'kvserve_gateway_requests_total{endpoint="completion",status="200"}' in metrics
    assert f'kvserve_executor_kv_usage{{executor="{executors[0].id}"}}' in metrics
