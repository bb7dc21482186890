"""A gateway that dies (SIGKILL) never says so: its executor notices its heartbeats stopped and aborts its
requests within seconds, freeing their KV blocks, while another gateway's requests run on."""

from __future__ import annotations

import re
import signal
import threading
import time

import httpx
import pytest

from executor.service.gateway_liveness import GatewayLiveness
from shared import redis_keys as keys
from shared.protocol import GATEWAY_SILENCE_S
from tests.gateway.answers import json_events
from tests.processes import eventually
from tests.stacks import serving_stack

BLOCK_SIZE = 16  # the default
ORPHAN_PROMPT_TOKENS = 300  # about: "orphan {i} story " x 75
ORPHAN_TOKENS = 700  # after their prompt: the tiny model's 1024 positions
KEPT_TOKENS = 1000


def test_only_a_gateway_that_heartbeats_can_fall_silent():
    liveness = GatewayLiveness(silence_s=4.0)
    liveness.heard(b"old", 0.0, heartbeat=False)  # a gateway that never heartbeats is never timed out
    liveness.heard(b"new", 0.0, heartbeat=True)
    liveness.heard(b"busy", 0.0, heartbeat=True)
    liveness.heard(b"busy", 3.0, heartbeat=False)  # any message counts as a sign of life
    assert liveness.gone(4.5) == [b"new"]
    assert liveness.gone(8.0) == [b"busy"]
    assert liveness.gone(100.0) == []  # each reported once


class Stream:
    """One long streaming completion from a thread: its events, and how it ended."""

    def __init__(self, base: str, prompt: str, max_tokens: int) -> None:
        self.events: list[dict] = []
        self.error: str | None = None
        self.leave = threading.Event()  # set: the client goes away
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens}
        body |= {"ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        self.thread = threading.Thread(target=self._run, args=(base, body), daemon=True)
        self.thread.start()

    def _run(self, base: str, body: dict) -> None:
        try:
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as response:
                for event in json_events(response.iter_lines()):
                    if self.leave.is_set():
                        return
                    self.events.append(event)
        except httpx.HTTPError as error:
            self.error = repr(error)


@pytest.mark.slow
def test_a_killed_gateways_requests_are_aborted_and_another_gateways_run_on(tiny_models, tmp_path):
    env = {"KVSERVE_CPU_KERNELS": "0"}  # no kernel build: this is about processes
    with serving_stack(tiny_models["llama"], tmp_path, gateways=2, env=env) as stack:
        executor, (doomed, survivor) = stack.executor, stack.gateways
        r = executor.redis

        def running() -> int:
            return int(r.hget(keys.load_key(executor.id), "running") or -1)

        def blocks_used() -> int:
            return int(r.hget(keys.stats_key(executor.id), "kv_blocks_used") or -1)

        # the orphans hold many blocks each (a long prompt of their own) and would run to about the same length
        # in all; the survivor, with a one-token prompt, runs longest
        orphans = [Stream(doomed.base, f"orphan {i} story " * 75, ORPHAN_TOKENS) for i in range(2)]
        kept = Stream(survivor.base, "hi", KEPT_TOKENS)
        assert eventually(lambda: running() == 3 and all(s.events for s in [*orphans, kept]), timeout=60)
        doomed.process.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        assert eventually(lambda: running() == 1, timeout=GATEWAY_SILENCE_S + 4), (
            executor.log_path.read_text()
        )
        aborted_after = time.monotonic() - killed
        assert not kept.events[-1].get("usage")  # the survivor runs on
        log = executor.log_path.read_text()
        # a closed connection is noticed at the next send (ROUTER_MANDATORY); a silent one by its heartbeats
        cut = [
            int(n)
            for n in re.findall(r"ended \((?:abort|gateway disconnected)\): .*? (\d+) output tokens", log)
        ]
        assert len(cut) == 2 and max(cut) < ORPHAN_TOKENS, log  # aborted, not run to their end
        print(f"a dead gateway's requests aborted {aborted_after:.1f} s after its SIGKILL, at {cut} tokens")
        # their blocks are free: fewer are used than their prompts alone held (the survivor, which generates at
        # their pace, holds a few), and it goes on streaming
        assert eventually(lambda: blocks_used() < 2 * ORPHAN_PROMPT_TOKENS // BLOCK_SIZE, timeout=2)
        seen = len(kept.events)
        assert eventually(lambda: len(kept.events) > seen + 5, timeout=10)
        kept.leave.set()
        assert eventually(lambda: running() == 0 and blocks_used() == 0, timeout=5)
