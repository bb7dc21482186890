"""What an executor publishes about itself for /metrics, and how it reads back: one Redis hash of numbers.

The executor writes its cumulative counters, gauges and queue-time histogram to `redis_keys.stats_key(id)`;
every gateway reads all live executors' hashes at scrape time, so one scrape of any gateway shows the stack.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# seconds a request waits between arriving at the executor and its first scheduled step
QUEUE_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

COUNTERS = (
    "prefix_cache_queried_tokens",
    "prefix_cache_hit_tokens",
    "preemptions",
    "spec_draft_tokens",
    "spec_accepted_tokens",
    "block_hash_mismatches",  # requests whose gateway's block hashes differ from the executor's own
)
GAUGES = ("kv_blocks_used", "kv_blocks_total", "running", "waiting")


@dataclass(slots=True)
class ExecutorStats:
    counters: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0.0))
    gauges: dict[str, float] = field(default_factory=lambda: dict.fromkeys(GAUGES, 0.0))
    # cumulative counts per bucket bound, the last for +Inf, as Prometheus histograms keep them
    queue_time_buckets: list[int] = field(default_factory=lambda: [0] * (len(QUEUE_TIME_BUCKETS) + 1))
    queue_time_sum: float = 0.0

    def observe_queue_time(self, seconds: float) -> None:
        for i, bound in enumerate(QUEUE_TIME_BUCKETS):
            if seconds <= bound:
                self.queue_time_buckets[i] += 1
        self.queue_time_buckets[-1] += 1
        self.queue_time_sum += seconds

    def to_hash(self) -> dict[str, float]:
        out: dict[str, float] = {**self.counters, **self.gauges, "queue_time_sum": self.queue_time_sum}
        for i, count in enumerate(self.queue_time_buckets):
            out[f"queue_time_bucket_{i}"] = count
        return out

    @classmethod
    def from_hash(cls, raw: dict) -> ExecutorStats:
        """Parse what Redis returns (bytes or str keys and values); missing fields read as 0."""
        values = {_text(k): float(v) for k, v in raw.items()}
        stats = cls()
        for name in COUNTERS:
            stats.counters[name] = values.get(name, 0.0)
        for name in GAUGES:
            stats.gauges[name] = values.get(name, 0.0)
        stats.queue_time_buckets = [
            int(values.get(f"queue_time_bucket_{i}", 0)) for i in range(len(QUEUE_TIME_BUCKETS) + 1)
        ]
        stats.queue_time_sum = values.get("queue_time_sum", 0.0)
        return stats


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
