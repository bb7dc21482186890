"""A gateway that stops reading (SIGSTOP: a paused process, a stalled event loop) while its streams run, with real
processes: Redis, one executor with a small send queue per gateway, two gateways. Every stream of the paused
gateway either arrives whole and exact or ends with an error the client sees: never a 200 with tokens missing,
never a hang; the other gateway's streams on the same executor go on meanwhile, whole."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.processes import eventually
from tests.stacks import serving_stack

ENV = {"KVSERVE_CPU_KERNELS": "0"}
# step messages queued per gateway in ZeroMQ, and as many more held by the executor (env: to measure others). Not 1:
# on a busy machine ZeroMQ's I/O thread then lags the executor by two steps now and again, and the gateway left
# running was dropped as behind (2 runs in 3 under two busy loops; none in 3 at 16). The paused gateway's 8 KB step
# messages still fill the kernel's buffer and these within a second of a 150-step stream.
SNDHWM = os.environ.get("KVSERVE_TEST_SNDHWM", "16")
PAUSE_S = float(os.environ.get("KVSERVE_TEST_PAUSE_S", "1"))  # once the executor holds updates for it
HOLDING = "is not reading fast enough"  # what the executor logs when it starts holding a gateway's updates
STREAMS = 4  # per gateway
MAX_TOKENS = 150
# choices of each of the paused gateway's requests: one update each per step, ~8 KB a step message in all, so
# the socket buffers to a stopped process fill within seconds and the executor has to hold (or give up) the rest
CHOICES = 16


@pytest.fixture(scope="module")
def stack(tiny_models, tmp_path_factory):
    """(gateway to pause, gateway left running, executor)."""
    logs = tmp_path_factory.mktemp("paused-gateway-logs")
    # over ipc the kernel holds about 200 KB for a stopped reader; over loopback TCP, megabytes
    flags = ("--zmq-sndhwm", SNDHWM, "--bind", f"ipc://{logs}/executor.sock")  # the last --bind counts
    with serving_stack(tiny_models["llama"], logs, executors=[flags], gateways=2, env=ENV) as stack:
        yield (*stack.gateways, stack.executor)


def body(i: int, n: int) -> dict:
    """Greedy, so its text is the same every run and every choice."""
    return {
        "n": n,
        "model": "tiny",
        "prompt": f"Stream number {i}, tell me about the number {i * 7}.",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


class Stream:
    """One streamed chat completion read in a thread: its text, usage, error event and when chunks came."""

    def __init__(self, base: str, i: int, n: int) -> None:
        self.base, self.i, self.n = base, i, n
        self.status: int | None = None
        self.texts, self.tokens, self.error, self.done = [""] * n, None, None, False
        self.arrivals: list[float] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        with httpx.stream(
            "POST", f"{self.base}/v1/completions", json=body(self.i, self.n), timeout=60
        ) as response:
            self.status = response.status_code
            if self.status != 200:
                self.error = response.read().decode()
                return
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                self.arrivals.append(time.monotonic())
                if line == "data: [DONE]":
                    self.done = True
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    self.error = event["error"]
                    continue
                for choice in event["choices"]:
                    self.texts[choice["index"]] += choice.get("text") or ""
                if event.get("usage"):
                    self.tokens = event["usage"]["completion_tokens"]

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"stream {self.i} hung"

    @property
    def exact(self) -> bool:
        return self.status == 200 and self.done and self.error is None and self.tokens == self.n * MAX_TOKENS


def run(base: str, n: int) -> list[Stream]:
    return [Stream(base, i, n) for i in range(STREAMS)]


def test_a_paused_gateway_loses_no_token_silently_and_the_other_gateway_goes_on(stack):
    paused, running, executor = stack
    victims, others = run(paused.base, CHOICES), run(running.base, 1)
    deadline = time.monotonic() + 30
    while not any(s.arrivals for s in victims) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(paused.process.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    filled = eventually(lambda: HOLDING in executor.log_path.read_text(), timeout=30)
    time.sleep(PAUSE_S)
    os.kill(paused.process.pid, signal.SIGCONT)
    resumed = time.monotonic()
    for stream in (*victims, *others):
        stream.join(60)

    for stream in others:  # the same prompts, never paused: what the paused gateway's streams should say
        assert stream.exact, (stream.i, stream.status, stream.tokens, stream.error)
    lost = 0
    for stream, ref in zip(victims, others, strict=True):
        assert stream.status == 200, (stream.i, stream.status, stream.error)
        if stream.error is None:  # whole: exactly what an unpaused run streams
            assert stream.exact and stream.texts == ref.texts * CHOICES, f"stream {stream.i} lost tokens"
        else:
            assert stream.error["type"] == "server_error", stream.error
            lost += 1
    print(
        f"paused {resumed - stopped:.1f} s: {STREAMS - lost} streams whole, {lost} ended with an error, 0 cut silently"
    )
    during = sum(stopped < t < resumed for s in others for t in s.arrivals)
    assert during > 0, "the running gateway's streams stalled while the other was paused"
    assert filled, "the socket buffers to the paused gateway never filled: the test proves nothing"
