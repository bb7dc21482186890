"""An executor that drains past its grace period aborts what still runs (finish reason "abort"): the gateway
reports that as the failure it is, never as a 200 with truncated text, and bills only what it delivered."""

from __future__ import annotations

import signal
import threading

import httpx

from shared import redis_keys as keys
from tests.gateway.answers import json_events
from tests.processes import eventually
from tests.stacks import serving_stack


def test_requests_cut_short_by_a_draining_executor_end_in_an_error(tiny_models, tmp_path):
    body = {"model": "tiny", "prompt": "a long story", "max_tokens": 900, "ignore_eos": True}
    grace = ("--shutdown-grace-period", "1")
    env = {"KVSERVE_CPU_KERNELS": "0"}  # no kernel build: this is about processes
    with serving_stack(tiny_models["llama"], tmp_path, executor_flags=grace, env=env) as stack:
        gateway, executor = stack.gateway, stack.executor
        events: list[dict] = []
        whole: list[httpx.Response] = []

        def stream() -> None:
            with httpx.stream(
                "POST", f"{gateway.base}/v1/completions", json={**body, "stream": True}, timeout=120
            ) as response:
                assert response.status_code == 200
                for event in json_events(response.iter_lines()):  # seen by the main thread as they come
                    events.append(event)

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
