"""Redis restarted under load: how soon routing locality and every request come back.

Starts a Redis of its own (kvserve.redis_server) and `kvserve up --redis-url` on it with two executors whose
KV pools hold about half of the prefix groups each (as bench/serving/routing.sh), runs a closed loop of
prefix-group requests, restarts Redis empty on the same port (no persistence: every key is lost) and reports
the cached share of prompt tokens before the restart and in windows after Redis is back, when each executor's
cached-block set in Redis is as large again as before, and when the last failed request ended.

    python -m bench.faults.redis_restart [--before 40] [--after 30] [--down 2] [--concurrency 4]

Targets (issue 13): cached share within 10% of before within 10 s of Redis returning; no request fails later than
2 s after Redis is back.
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis

from bench.prompts import PrefixWorkload, tokenizer_counter
from kvserve.redis_server import free_port, start_redis_server
from shared import redis_keys

WINDOWS_S = ((0, 2), (2, 5), (5, 10), (10, 20), (20, 60))


@dataclass(slots=True)
class Result:
    sent: float
    ended: float
    status: int
    prompt_tokens: int = 0
    cached_tokens: int = 0


def cached_share(results: list[Result]) -> float:
    prompt = sum(r.prompt_tokens for r in results)
    return sum(r.cached_tokens for r in results) / prompt if prompt else 0.0


def _serve(url: str, workload: PrefixWorkload, numbers, results: list[Result], stop: threading.Event):
    """One client, back to back; request i (from the shared numbers) gets group i mod G, as bench/serving/routing.sh."""
    with httpx.Client(base_url=url, timeout=120) as client:
        while not stop.is_set():
            i = next(numbers)
            body = {"prompt": workload.prompt(i).text, "max_tokens": 1, "temperature": 0, "model": "default"}
            sent = time.monotonic()
            try:
                response = client.post("/v1/completions", json=body)
                status = response.status_code
            except httpx.HTTPError:
                status = 0
            result = Result(sent, time.monotonic(), status)
            if status == 200:
                usage = response.json()["usage"]
                result.prompt_tokens = usage["prompt_tokens"]
                result.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
            results.append(result)
            if status != 200:
                time.sleep(0.1)  # a client that got 503 tries again soon, not in a tight loop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--kv-cache-memory", default="200MiB")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--before", type=float, default=40.0, help="seconds of load before the restart")
    parser.add_argument("--after", type=float, default=30.0, help="seconds of load after Redis is back")
    parser.add_argument("--down", type=float, default=2.0, help="seconds Redis stays down")
    parser.add_argument("--log", default="bench/results/redis-restart.log")
    args = parser.parse_args(argv)

    from executor import resolve_model

    model = str(resolve_model(args.model))
    workload = PrefixWorkload(args.groups, args.prefix_tokens, 32, count_tokens=tokenizer_counter(model))
    server = start_redis_server()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    Path(args.log).parent.mkdir(parents=True, exist_ok=True)
    up_argv = [sys.executable, "-m", "kvserve.cli", "up", "--redis-url", server.url, "--port", str(port)]
    up_argv += ["--executors", "2", "--model", model, "--served-model-name", "default"]
    up_argv += ["--kv-cache-memory", args.kv_cache_memory, "--max-model-len", "2048"]
    with open(args.log, "wb") as log:
        up = subprocess.Popen(up_argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while "executor-1" not in _health(url):
            if up.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"kvserve up did not come up; see {args.log}")
            time.sleep(1)
        results: list[Result] = []
        stop = threading.Event()
        numbers = itertools.count()  # next() on it is atomic: the clients share one sequence
        workers = [
            threading.Thread(target=_serve, args=(url, workload, numbers, results, stop))
            for _ in range(args.concurrency)
        ]
        started = time.monotonic()
        for worker in workers:
            worker.start()
        time.sleep(args.before)
        client = redis.Redis.from_url(server.url)
        index = {e: (_blocks(client, e), None) for e in ("executor-0", "executor-1")}
        restart_at = time.monotonic()
        server.kill()  # not persistent: it comes back empty, as after a failover or a restart
        time.sleep(args.down)
        server.restart()
        back = time.monotonic()
        while time.monotonic() < back + args.after:  # when each executor's index is whole again
            for executor_id, (size, at) in index.items():
                if at is None and _blocks(client, executor_id) >= size:
                    index[executor_id] = (size, time.monotonic())
            time.sleep(0.05)
        stop.set()
        for worker in workers:
            worker.join()
    finally:
        up.send_signal(2)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
        server.stop()

    warm = [r for r in results if started + args.before / 2 <= r.sent and r.ended < restart_at]
    print(
        f"before the restart (last {args.before / 2:.0f} s): {len(warm)} requests, cached {cached_share(warm):.1%}"
    )
    for low, high in WINDOWS_S:
        window = [r for r in results if back + low <= r.sent < back + high and r.status == 200]
        if window:
            print(
                f"sent {low:>2}-{high:<2} s after Redis was back: {len(window)} ok, cached {cached_share(window):.1%}"
            )
    failed = [r for r in results if r.status != 200]
    print(f"failed: {len(failed)} of {len(results)} (status {sorted({r.status for r in failed})})")
    if failed:
        print(
            f"last failure ended {max(r.ended for r in failed) - back:+.2f} s from Redis back (target: < 2 s)"
        )
    for executor_id, (size, at) in sorted(index.items()):
        when = f"{at - back:.2f} s after Redis was back" if at is not None else "not within --after"
        print(f"{executor_id}: {size} cached blocks in Redis before the restart, as many again {when}")
    return 0


def _blocks(client: redis.Redis, executor_id: str) -> int:
    """How many block hashes the executor's set in Redis holds (its marker aside)."""
    try:
        return max(0, client.scard(redis_keys.blocks_key(executor_id)) - 1)
    except redis.RedisError:
        return 0


def _health(url: str) -> str:
    try:
        return httpx.get(f"{url}/health", timeout=5).text
    except httpx.HTTPError:
        return ""


if __name__ == "__main__":
    sys.exit(main())
