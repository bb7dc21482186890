"""Part (b): a prefix pulled from a peer executor against the same prefix computed, at several lengths.

Two `kvserve executor`s (A and B) share one Redis, each serving KV pulls (--kv-transfer-port). This benchmark
talks to them as a gateway does, over ZeroMQ with shared.protocol's messages, so it alone decides where each
request goes: A computes a prompt of random tokens (max_tokens 1); B is then sent the same prompt with kv_peer
naming A (it pulls A's blocks and computes only the last block's tokens), and a fresh random prompt of the same
length without a peer (it computes everything). Time to first token is from the send to the first update that
carries a token. Every prompt is new to both executors, so nothing else is cached.
"""

from __future__ import annotations

import contextlib
import os
import random
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import redis
import zmq

from bench.kv_tiers.workload import Row, ms, random_token_prompt, ratio
from kvserve.redis_server import free_port, start_redis_server
from kvserve.supervisor import stop_processes
from shared import protocol
from shared import redis_keys as keys
from shared.block_hash import hash_blocks
from shared.defaults import DEFAULT_BLOCK_SIZE
from shared.parent_death import dying_with_this_process

EXECUTORS = ("executor-a", "executor-b")
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0
REPLY_TIMEOUT_S = 600.0
TARGET_TOKENS, TARGET = 2048, 0.25  # the target: a pull at most a quarter of recompute at 2k tokens


class ExecutorLine:
    """A gateway's DEALER connection to one executor, one request at a time."""

    def __init__(self, context: zmq.Context, address: str) -> None:
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)

    def first_token(self, prompt: list[int], peer: protocol.KVPeer | None = None) -> tuple[float, int]:
        """Seconds to the first token and the prompt tokens the executor did not compute; waits for the end, so
        the next measurement starts on an idle executor."""
        request_id = uuid.uuid4().hex
        hashes = hash_blocks(prompt, DEFAULT_BLOCK_SIZE)
        sampling = {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True}
        request = protocol.GenerateRequest(request_id, prompt, hashes, sampling, kv_peer=peer)
        sent = time.perf_counter()
        self.socket.send(protocol.encode(request))
        ttft, cached = None, 0
        while True:
            if not self.socket.poll(int(REPLY_TIMEOUT_S * 1000)):
                raise RuntimeError(f"no answer to {request_id} within {REPLY_TIMEOUT_S:.0f} s")
            msg = protocol.decode(self.socket.recv())
            if isinstance(msg, protocol.RequestError) and msg.request_id == request_id:
                raise RuntimeError(f"the executor refused the request ({msg.code}): {msg.message}")
            for update in msg.outputs if isinstance(msg, protocol.StepBatch) else []:
                if update.request_id != request_id:
                    continue
                if update.token_ids and ttft is None:
                    ttft, cached = time.perf_counter() - sent, update.num_cached_tokens
                if update.finish_reason is not None:
                    return ttft if ttft is not None else time.perf_counter() - sent, cached


@contextlib.contextmanager
def two_executors(model: str | None, flags: list[str], log_dir: Path) -> Iterator[dict[str, tuple[str, str]]]:
    """executor id -> (its request address, its KV transfer address), both registered; stopped (SIGTERM, then
    SIGKILL) with their Redis however the block ends."""
    server = start_redis_server()
    processes: list[subprocess.Popen] = []
    # two CPU executors share the cores, as `kvserve up --executors 2` splits them (kvserve/local_stack.py)
    threads = str(max(1, len(os.sched_getaffinity(0)) // len(EXECUTORS)))
    env = {**os.environ, "KVSERVE_REDIS_URL": server.url, "OMP_NUM_THREADS": threads}
    try:
        binds = {}
        for executor_id in EXECUTORS:
            binds[executor_id] = f"tcp://127.0.0.1:{free_port()}"
            argv = [sys.executable, "-m", "kvserve.cli", "executor", "--executor-id", executor_id]
            argv += ["--bind", binds[executor_id], "--kv-transfer-port", str(free_port())]
            argv += ["--device", "cpu", "--dtype", "float32", "--log-format", "text", *flags]
            argv += [] if model is None else ["--model", model]
            argv = dying_with_this_process(argv)  # even when this process is killed outright
            with open(log_dir / f"kv_tiers_pulls_{executor_id}.log", "wb") as log:
                processes.append(
                    subprocess.Popen(
                        argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
                    )
                )
        client = redis.Redis.from_url(server.url, decode_responses=True)
        yield {i: (binds[i], _transfer_address(client, i, processes, log_dir)) for i in EXECUTORS}
    finally:
        stop_processes(processes, STOP_TIMEOUT_S)
        server.stop()


def _transfer_address(
    client: redis.Redis, executor_id: str, processes: list[subprocess.Popen], log_dir: Path
) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in processes):
            raise RuntimeError(f"an executor exited while starting; see {log_dir}/kv_tiers_pulls_*.log")
        address = client.hget(keys.executor_key(executor_id), "kv_transfer_address")
        if address:
            return address
        time.sleep(0.5)
    raise RuntimeError(f"{executor_id} did not register a kv_transfer_address in {START_TIMEOUT_S:.0f} s")


def measure(
    lengths: list[int],
    repeats: int,
    vocab_size: int,
    max_model_len: int,
    model: str | None,
    flags: list[str],
    log_dir: Path,
    seed: int,
) -> dict:
    rng = random.Random(seed)
    print(f"(b) two executors, kvserve executor {' '.join(flags)}", flush=True)
    with two_executors(model, flags, log_dir) as executors:
        context = zmq.Context()
        try:
            a, b = (ExecutorLine(context, executors[i][0]) for i in EXECUTORS)
            peer_address = executors[EXECUTORS[0]][1]
            for line in (a, b):  # the first request of a process pays for its lazy start-up
                line.first_token(random_token_prompt(rng, 4 * DEFAULT_BLOCK_SIZE, vocab_size))
            warm = random_token_prompt(rng, 4 * DEFAULT_BLOCK_SIZE, vocab_size)
            a.first_token(warm)
            b.first_token(warm, protocol.KVPeer(EXECUTORS[0], peer_address, 4))  # and B's first pull
            report = {"lengths": {}}
            for asked in lengths:
                length = min(asked, max_model_len - DEFAULT_BLOCK_SIZE)  # room for the one output token
                samples = _samples(a, b, peer_address, length, repeats, vocab_size, rng)
                pull, recompute = (statistics.median(samples[k]) for k in ("pull", "recompute"))
                report["lengths"][str(length)] = {
                    "asked_tokens": asked,
                    "pull_ttft_s": pull,
                    "recompute_ttft_s": recompute,
                    "pull_over_recompute": ratio(pull, recompute),
                    **samples,
                }
            return report
        finally:
            context.destroy(linger=0)


def _samples(
    a: ExecutorLine,
    b: ExecutorLine,
    peer_address: str,
    length: int,
    repeats: int,
    vocab_size: int,
    rng: random.Random,
) -> dict[str, list]:
    """TTFT at B of each try's pull and recompute, and the prompt tokens B did not compute in each."""
    samples: dict[str, list] = {
        "pull": [],
        "recompute": [],
        "pulled_tokens": [],
        "recompute_cached_tokens": [],
    }
    for r in range(repeats):
        prompt = random_token_prompt(rng, length, vocab_size)
        a.first_token(prompt)
        peer = protocol.KVPeer(EXECUTORS[0], peer_address, length // DEFAULT_BLOCK_SIZE)
        # alternated, so neither always runs right after A's prefill
        for kind in ("pull", "recompute") if r % 2 == 0 else ("recompute", "pull"):
            if kind == "pull":
                ttft, cached = b.first_token(prompt, peer)
                samples["pulled_tokens"].append(cached)
            else:
                ttft, cached = b.first_token(random_token_prompt(rng, length, vocab_size))
                samples["recompute_cached_tokens"].append(cached)
            samples[kind].append(ttft)
        print(
            f"(b) {length} tokens, try {r + 1}: pull {samples['pull'][-1]:.3f} s "
            f"({samples['pulled_tokens'][-1]} tokens not computed), recompute {samples['recompute'][-1]:.3f} s",
            flush=True,
        )
    return samples


def rows(report: dict, repeats: int) -> list[Row]:
    out = []
    for length, m in report["lengths"].items():
        share = ratio(m["pull_ttft_s"], m["recompute_ttft_s"])
        at_target = m["asked_tokens"] == TARGET_TOKENS
        pulled = min(m["pulled_tokens"], default=0)
        out.append(
            Row(
                "(b)",
                f"TTFT, {length}-token prefix, median of {repeats} (baseline: recompute; least pulled "
                f"{pulled} tokens)",
                ms(m["recompute_ttft_s"]),
                ms(m["pull_ttft_s"]),
                "-" if share is None else f"{share:.2f}x",
                f"<= {TARGET}x" if at_target else "",
                None if not at_target or share is None else share <= TARGET,
            )
        )
    return out
