"""Whether work sits on one executor while another idles: every executor's published load, sampled from Redis.

Runs beside a load (bench/faults/overload.sh) until interrupted, then prints and writes: samples taken, the share of
samples in which some executor was idle (nothing running, nothing waiting) while another had requests waiting,
the longest such stretch, and each executor's largest waiting queue and running count.

    python -m bench.faults.balance --redis-url redis://127.0.0.1:6379/0 --output balance.json   # Ctrl-C (SIGINT) ends
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import asdict, dataclass, field

import redis

from shared import redis_keys

INTERVAL_S = 0.1


@dataclass(slots=True)
class Balance:
    samples: int = 0
    busy_samples: int = 0  # samples in which some executor had work (running or waiting)
    idle_while_queued: int = 0  # samples with an idle executor while another had requests waiting
    longest_idle_while_queued_s: float = 0.0
    max_waiting: dict[str, int] = field(default_factory=dict)
    max_running: dict[str, int] = field(default_factory=dict)
    _stretch_started: float | None = None

    def add(self, now: float, loads: dict[str, tuple[int, int]]) -> None:
        """loads: executor id -> (running, waiting)."""
        self.samples += 1
        for executor_id, (running, waiting) in loads.items():
            self.max_running[executor_id] = max(self.max_running.get(executor_id, 0), running)
            self.max_waiting[executor_id] = max(self.max_waiting.get(executor_id, 0), waiting)
        self.busy_samples += any(r or w for r, w in loads.values())
        idle = any(r == 0 and w == 0 for r, w in loads.values())
        if idle and any(w > 0 for _, w in loads.values()):
            self.idle_while_queued += 1
            if self._stretch_started is None:
                self._stretch_started = now
            self.longest_idle_while_queued_s = max(
                self.longest_idle_while_queued_s, now - self._stretch_started + INTERVAL_S
            )
        else:
            self._stretch_started = None

    def report(self) -> dict:
        out = asdict(self)
        del out["_stretch_started"]
        out["idle_while_queued_share"] = self.idle_while_queued / self.samples if self.samples else 0.0
        return out


def read_loads(client: redis.Redis) -> dict[str, tuple[int, int]]:
    """Live executors' (running, waiting), in one pipeline."""
    ids = sorted(member.decode() for member in client.smembers(redis_keys.EXECUTORS))
    pipe = client.pipeline(transaction=False)
    for executor_id in ids:
        pipe.exists(redis_keys.executor_key(executor_id))
        pipe.hmget(redis_keys.load_key(executor_id), "running", "waiting")
    replies = pipe.execute()
    loads = {}
    for i, executor_id in enumerate(ids):
        alive, (running, waiting) = replies[2 * i], replies[2 * i + 1]
        if alive:
            loads[executor_id] = (int(float(running or 0)), int(float(waiting or 0)))
    return loads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.faults.balance", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--output", default=None, help="write the report as JSON here too")
    args = parser.parse_args(argv)
    client = redis.Redis.from_url(args.redis_url)
    balance = Balance()
    stop = False

    def on_signal(*_args) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    while not stop:
        balance.add(time.monotonic(), read_loads(client))
        time.sleep(INTERVAL_S)
    report = balance.report()
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
