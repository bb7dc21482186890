"""The stack's Prometheus metrics, as one scrape of any gateway shows them.

The gateway's own series (requests by tenant and status, tokens, latencies as its clients see them, routing
decisions) live in a registry per Gateway (several apps may share a test process). The executors' series
(prefix cache, preemptions, speculative decoding, KV blocks, queue time) are read from the stats each one
publishes to Redis (shared.executor_stats), fresh at every scrape, labelled by executor.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from shared.executor_stats import QUEUE_TIME_BUCKETS, ExecutorStats

# seconds; fine at the low end, where the gateway's own overhead and inter-token gaps live
_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.003,
    0.004,
    0.005,
    0.0075,
    0.01,
    0.02,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
_REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# executor stats field -> (metric name, help)
_EXECUTOR_COUNTERS = {
    "prefix_cache_queried_tokens": (
        "kvserve_prefix_cache_queried_tokens",
        "Prompt tokens looked up in each executor's prefix cache.",
    ),
    "prefix_cache_hit_tokens": (
        "kvserve_prefix_cache_hit_tokens",
        "Prompt tokens found in each executor's prefix cache.",
    ),
    "preemptions": ("kvserve_preemptions", "Requests each executor preempted for lack of KV blocks."),
    "spec_draft_tokens": (
        "kvserve_spec_decode_draft_tokens",
        "Speculative tokens proposed on each executor.",
    ),
    "spec_accepted_tokens": (
        "kvserve_spec_decode_accepted_tokens",
        "Speculative tokens each executor's verification accepted.",
    ),
    "block_hash_mismatches": (
        "kvserve_block_hash_mismatches",
        "Requests whose gateway's block hashes differed from each executor's own (block size, salt, hashing).",
    ),
}
_EXECUTOR_GAUGES = {
    "kv_blocks_used": ("kvserve_kv_blocks_used", "KV cache blocks in use on each executor."),
    "kv_blocks_total": ("kvserve_kv_blocks_total", "KV cache blocks each executor has."),
    "running": ("kvserve_running_requests", "Requests running on each executor."),
    "waiting": ("kvserve_waiting_requests", "Requests waiting on each executor."),
}


class ExecutorStatsCollector:
    """Yields the executors' series from the snapshot read from Redis just before rendering."""

    def __init__(self) -> None:
        self.snapshot: dict[str, ExecutorStats] = {}

    def collect(self):
        for field, (name, text) in _EXECUTOR_COUNTERS.items():
            family = CounterMetricFamily(name, text, labels=["executor"])
            for executor_id, stats in self.snapshot.items():
                family.add_metric([executor_id], stats.counters[field])
            yield family
        for field, (name, text) in _EXECUTOR_GAUGES.items():
            family = GaugeMetricFamily(name, text, labels=["executor"])
            for executor_id, stats in self.snapshot.items():
                family.add_metric([executor_id], stats.gauges[field])
            yield family
        queue = HistogramMetricFamily(
            "kvserve_queue_time_seconds",
            "Time requests waited on an executor between arriving and their first scheduled step.",
            labels=["executor"],
        )
        bounds = [str(b) for b in QUEUE_TIME_BUCKETS] + ["+Inf"]
        for executor_id, stats in self.snapshot.items():
            buckets = list(zip(bounds, stats.queue_time_buckets, strict=True))
            queue.add_metric([executor_id], buckets, stats.queue_time_sum)
        yield queue


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvserve_requests",
            "HTTP completion requests answered, by tenant, endpoint and status code.",
            ["tenant", "endpoint", "status"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "kvserve_prompt_tokens", "Prompt tokens of requests served.", ["tenant"], registry=self.registry
        )
        self.prompt_tokens_cached = Counter(
            "kvserve_prompt_tokens_cached",
            "Prompt tokens whose KV came from an executor's prefix cache (not computed).",
            ["tenant"],
            registry=self.registry,
        )
        self.prompt_tokens_computed = Counter(
            "kvserve_prompt_tokens_computed",
            "Prompt tokens an executor computed (prefilled): prompt tokens less cached ones.",
            ["tenant"],
            registry=self.registry,
        )
        self.kv_block_seconds = Counter(
            "kvserve_kv_block_seconds",
            "KV cache blocks requests held on the executors, times the seconds they held them (x --block-size: "
            "token-seconds of KV).",
            ["tenant"],
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "kvserve_generation_tokens", "Tokens generated.", ["tenant"], registry=self.registry
        )
        self.ttft = Histogram(
            "kvserve_time_to_first_token_seconds",
            "Request arrival at the gateway to its first token leaving it.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token = Histogram(
            "kvserve_inter_token_latency_seconds",
            "Time between a request's consecutive output tokens, as the gateway received them.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "kvserve_e2e_request_latency_seconds",
            "Request arrival at the gateway to its end.",
            buckets=_REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.added_latency = Histogram(
            "kvserve_gateway_added_latency_seconds",
            "The gateway's own share of time to first token: its TTFT minus the span from handing the request "
            "to ZeroMQ to the first token coming back, and minus any time it was held waiting for an executor "
            "with room (kvserve_gateway_queue_time_seconds).",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue_time = Histogram(
            "kvserve_gateway_queue_time_seconds",
            "Time a request was held at the gateway because every executor's queue was full (back-pressure), "
            "observed for every routed request (0 when it was not held).",
            buckets=_REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.route_decisions = Counter(
            "kvserve_route_decisions",
            "Routing decisions by policy and reason (prefix_hit: the chosen executor held part of the prompt; "
            "least_loaded: none did, load decided; retry: the first choice died before answering).",
            ["policy", "reason"],
            registry=self.registry,
        )
        self.executor_stats_missing = Counter(
            "kvserve_metrics_executor_stats_missing",
            "Scrapes of /metrics that left the executors' series out: Redis did not answer in time.",
            registry=self.registry,
        )
        self.executors = ExecutorStatsCollector()
        self.registry.register(self.executors)

    def first_token(self, gateway_ttft_s: float, executor_ttft_s: float | None, held_s: float = 0.0) -> None:
        """held_s: time the request waited at the gateway for an executor with room, a queue rather than the
        gateway's own work, so it is left out of the added latency."""
        self.ttft.observe(gateway_ttft_s)
        self.queue_time.observe(held_s)
        if executor_ttft_s is not None:
            self.added_latency.observe(max(0.0, gateway_ttft_s - executor_ttft_s - held_s))

    def count_usage(
        self, tenant: str, prompt_tokens: int, cached_tokens: int, kv_block_seconds: float
    ) -> None:
        """What an ended request used, as its tenant's usage hash counts it (gateway.tenants.rate_limits)."""
        self.prompt_tokens.labels(tenant).inc(prompt_tokens)
        self.prompt_tokens_cached.labels(tenant).inc(cached_tokens)
        self.prompt_tokens_computed.labels(tenant).inc(max(0, prompt_tokens - cached_tokens))
        self.kv_block_seconds.labels(tenant).inc(kv_block_seconds)

    def tokens_arrived(self, tenant: str, count: int, gap_s: float | None) -> None:
        """count new tokens in one update, gap_s after the previous update (None for the first)."""
        self.generation_tokens.labels(tenant).inc(count)
        if gap_s is not None and count:
            per_token = gap_s / count  # speculative decoding delivers several tokens at once
            for _ in range(count):
                self.inter_token.observe(per_token)

    def render(self, executor_stats: dict[str, ExecutorStats] | None) -> bytes:
        """None: the executors' stats could not be read; their series are left out, counted, and a comment says so."""
        if executor_stats is None:
            self.executor_stats_missing.inc()
            self.executors.snapshot = {}
            note = b"# executor series omitted: their stats could not be read from Redis\n"
            return note + generate_latest(self.registry)
        self.executors.snapshot = executor_stats
        return generate_latest(self.registry)
