"""An executor that drains past its grace period aborts what still runs (finish reason "abort"): the gateway
reports that as the failure it is, never as a 200 with truncated text, and bills only what it delivered."""

from __future__ import annotations

import json
import signal
import threading

import httpx

from kvserve.redis_server import start_redis_server
from shared import redis_keys as keys
from tests.processes import ExecutorProcess, GatewayProcess, eventually


def test_requests_cut_short_by_a_draining_executor_end_in_an_error(tiny_models, tmp_path):
    model = tiny_models["llama"]
    body = {"model": "tiny", "prompt": "a long story", "max_tokens": 900, "ignore_eos": True}
    server = start_redis_server()
    grace = ("--shutdown-grace-period", "1")
    env = {"KVSERVE_CPU_KERNELS": "0"}  # no kernel build: this is about processes
    executor = ExecutorProcess(model, server.url, tmp_path / "executor.log", *grace, env=env)
    gateway = GatewayProcess(model, server.url, tmp_path / "gateway.log")
    try:
        executor.wait_registered(timeout=180)
        gateway.wait_healthy(timeout=120)
        events: list[dict] = []
        whole: list[httpx.Response] = []

        def stream() -> None:
            with httpx.stream(
                "POST", f"{gateway.base}/v1/completions", json={**body, "stream": True}, timeout=120
            ) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line.removeprefix("data: ")))

        def complete() -> None:
            whole.append(httpx.post(f"{gateway.base}/v1/completions", json=body, timeout=120))

        threads = [threading.Thread(target=stream), threading.Thread(target=complete)]
        for thread in threads:
            thread.start()
        running = lambda: executor.redis.hget(keys.load_key(executor.id), "running")  # noqa: E731
        assert eventually(lambda: len(events) > 3 and running() == "2", timeout=60)
        executor.process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(60)
        (response,) = whole
        # nothing reached this client: it is told so (no executor is left to retry on), not handed cut text
        assert response.status_code in (502, 503), response.text
        assert set(response.json()["error"]) >= {"message", "type", "code"}
        # the stream had tokens: it ends with an error event, never with a finish reason
        assert "error" in events[-1], events[-1]
        assert not any(c.get("finish_reason") for e in events[:-1] for c in e.get("choices", []))
        assert "cut the request short" in gateway.log_path.read_text()
    finally:
        for process in (gateway, executor):
            process.stop()
        server.stop()
