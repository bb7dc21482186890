"""What an executor publishes about itself for /metrics, and how it reads back: one Redis hash of numbers.

The executor writes its cumulative counters, gauges and histograms to `redis_keys.stats_key(id)`; every gateway
reads all live executors' hashes at scrape time, so one scrape of any gateway shows the stack.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# seconds a request waits between arriving at the executor and its first scheduled step
QUEUE_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# seconds from arriving at the executor to its first token, and to its end (vLLM's engine-side measures)
TIME_TO_FIRST_TOKEN_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
E2E_REQUEST_LATENCY_BUCKETS = (
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
# seconds one peer pull took, asked to delivered (bounded by --kv-pull-timeout; a fast pull of a few blocks is ms)
KV_PULL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

COUNTERS = (
    "prefix_cache_queried_tokens",
    "prefix_cache_hit_tokens",
    "preemptions",
    "spec_draft_tokens",
    "spec_accepted_tokens",
    "block_hash_mismatches",  # requests whose gateway's block hashes differ from the executor's own
    "prompt_tokens",  # of requests prefilled here (counted at their first token)
    "generation_tokens",
    # prompt tokens not computed, by where their KV came from (issue 48's tiers; their sum is what usage calls
    # cached_tokens)
    "kv_cached_tokens_pool",
    "kv_cached_tokens_host",
    "kv_cached_tokens_disk",
    "kv_cached_tokens_peer",
    # bytes copied between the pool and each tier below it, and pulled from peers
    "kv_offloaded_bytes_host",
    "kv_offloaded_bytes_disk",
    "kv_loaded_bytes_host",
    "kv_loaded_bytes_disk",
    "kv_pulled_bytes",
    "kv_pulls",
    "kv_pulls_failed",  # pulls that delivered fewer blocks than asked (dead, slow or refusing peer, bad block)
    "kv_disk_files_rejected",  # corrupt, truncated or foreign block files skipped
)
GAUGES = (
    "kv_blocks_used",
    "kv_blocks_total",
    "running",
    "waiting",
    "kv_host_blocks_used",  # slots of the host tier holding a block (0 / 0 when the tier is off)
    "kv_host_blocks_total",
    "kv_disk_blocks_used",
    "kv_disk_blocks_total",
)
# name -> upper bounds; the hash holds f"{name}_bucket_{i}" (cumulative, the last for +Inf) and f"{name}_sum"
HISTOGRAMS = {
    "queue_time": QUEUE_TIME_BUCKETS,
    "time_to_first_token": TIME_TO_FIRST_TOKEN_BUCKETS,
    "e2e_request_latency": E2E_REQUEST_LATENCY_BUCKETS,
    "kv_pull_seconds": KV_PULL_BUCKETS,
}


@dataclass(slots=True)
class Histogram:
    """Cumulative counts per bucket bound, the last for +Inf, as Prometheus histograms keep them."""

    bounds: tuple[float, ...]
    buckets: list[int] = field(default_factory=list)
    sum: float = 0.0

    def __post_init__(self) -> None:
        self.buckets = self.buckets or [0] * (len(self.bounds) + 1)

    def observe(self, seconds: float) -> None:
        for i, bound in enumerate(self.bounds):
            if seconds <= bound:
                self.buckets[i] += 1
        self.buckets[-1] += 1
        self.sum += seconds


@dataclass(slots=True)
class ExecutorStats:
    counters: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0.0))
    gauges: dict[str, float] = field(default_factory=lambda: dict.fromkeys(GAUGES, 0.0))
    histograms: dict[str, Histogram] = field(
        default_factory=lambda: {name: Histogram(bounds) for name, bounds in HISTOGRAMS.items()}
    )

    def observe_queue_time(self, seconds: float) -> None:
        self.histograms["queue_time"].observe(seconds)

    def to_hash(self) -> dict[str, float]:
        out: dict[str, float] = {**self.counters, **self.gauges}
        for name, histogram in self.histograms.items():
            out[f"{name}_sum"] = histogram.sum
            for i, count in enumerate(histogram.buckets):
                out[f"{name}_bucket_{i}"] = count
        return out

    @classmethod
    def from_hash(cls, raw: dict) -> ExecutorStats:
        """Parse what Redis returns (bytes or str keys and values); missing fields read as 0 (an executor of an
        older version publishes fewer)."""
        values = {_text(k): float(v) for k, v in raw.items()}
        stats = cls()
        for name in COUNTERS:
            stats.counters[name] = values.get(name, 0.0)
        for name in GAUGES:
            stats.gauges[name] = values.get(name, 0.0)
        for name, histogram in stats.histograms.items():
            histogram.buckets = [
                int(values.get(f"{name}_bucket_{i}", 0)) for i in range(len(histogram.buckets))
            ]
            histogram.sum = values.get(f"{name}_sum", 0.0)
        return stats


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
