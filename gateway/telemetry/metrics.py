"""The stack's Prometheus metrics, as one scrape of any gateway shows them.

The gateway's own series (requests by tenant and status, tokens, latencies as its clients see them, routing
decisions) live in a registry per Gateway (several apps may share a test process). The executors' series
(prefix cache, preemptions, speculative decoding, KV blocks and tiers, peer pulls, latencies) are read from the stats each one
publishes to Redis (shared.executor_stats), fresh at every scrape, labelled by executor; Redis's own memory beside them
(gateway.telemetry.redis_memory).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from gateway.telemetry.redis_memory import RedisMemoryCollector
from shared.executor_stats import E2E_REQUEST_LATENCY_BUCKETS, ExecutorStats

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
_REQUEST_BUCKETS = E2E_REQUEST_LATENCY_BUCKETS  # the executors' end-to-end histogram's, so the two compare

# executor stats field -> (metric name, help, vLLM's name for the same series or None)
_EXECUTOR_COUNTERS = {
    "prefix_cache_queried_tokens": (
        "kvserve_prefix_cache_queried_tokens",
        "Prompt tokens looked up in each executor's prefix cache.",
        "vllm:prefix_cache_queries",
    ),
    "prefix_cache_hit_tokens": (
        "kvserve_prefix_cache_hit_tokens",
        "Prompt tokens found in each executor's prefix cache.",
        "vllm:prefix_cache_hits",
    ),
    "preemptions": (
        "kvserve_preemptions",
        "Requests each executor preempted for lack of KV blocks.",
        "vllm:num_preemptions",
    ),
    "spec_draft_tokens": (
        "kvserve_spec_decode_draft_tokens",
        "Speculative tokens proposed on each executor.",
        "vllm:spec_decode_num_draft_tokens",
    ),
    "spec_accepted_tokens": (
        "kvserve_spec_decode_accepted_tokens",
        "Speculative tokens each executor's verification accepted.",
        "vllm:spec_decode_num_accepted_tokens",
    ),
    "block_hash_mismatches": (
        "kvserve_block_hash_mismatches",
        "Requests whose gateway's block hashes differed from each executor's own (block size, salt, hashing).",
        None,
    ),
    "prompt_tokens": (
        "kvserve_executor_prompt_tokens",
        "Prompt tokens of requests each executor prefilled (cached ones included), counted at their first token.",
        "vllm:prompt_tokens",
    ),
    "generation_tokens": (
        "kvserve_executor_generation_tokens",
        "Tokens each executor generated.",
        "vllm:generation_tokens",
    ),
    # where the KV of prompt tokens not computed came from (issue 48's tiers): their sum is usage's cached_tokens
    "kv_cached_tokens_pool": (
        "kvserve_kv_pool_cached_tokens",
        "Prompt tokens each executor did not compute: their KV was in its pool (its prefix cache).",
        None,
    ),
    "kv_cached_tokens_host": (
        "kvserve_kv_host_cached_tokens",
        "Prompt tokens each executor did not compute: their KV was loaded from its host memory tier.",
        None,
    ),
    "kv_cached_tokens_disk": (
        "kvserve_kv_disk_cached_tokens",
        "Prompt tokens each executor did not compute: their KV was loaded from its disk tier.",
        None,
    ),
    "kv_cached_tokens_peer": (
        "kvserve_kv_peer_cached_tokens",
        "Prompt tokens each executor did not compute: their KV was pulled from another executor.",
        None,
    ),
    "kv_offloaded_bytes_host": (
        "kvserve_kv_host_offloaded_bytes",
        "KV bytes each executor copied from its pool to its host tier.",
        None,
    ),
    "kv_offloaded_bytes_disk": (
        "kvserve_kv_disk_offloaded_bytes",
        "KV bytes each executor wrote from its pool to its disk tier.",
        None,
    ),
    "kv_loaded_bytes_host": (
        "kvserve_kv_host_loaded_bytes",
        "KV bytes each executor loaded into its pool from its host tier.",
        None,
    ),
    "kv_loaded_bytes_disk": (
        "kvserve_kv_disk_loaded_bytes",
        "KV bytes each executor loaded into its pool from its disk tier.",
        None,
    ),
    "kv_pulled_bytes": ("kvserve_kv_pulled_bytes", "KV bytes each executor pulled from peers.", None),
    "kv_pulls": ("kvserve_kv_pulls", "KV pulls each executor made from a peer.", None),
    "kv_pulls_failed": (
        "kvserve_kv_pulls_failed",
        "KV pulls that delivered fewer blocks than asked (a dead, slow or refusing peer, or a bad block): the "
        "rest was computed.",
        None,
    ),
    "kv_disk_files_rejected": (
        "kvserve_kv_disk_files_rejected",
        "Block files each executor's disk tier skipped and removed: corrupt, truncated or made by another "
        "model, dtype, block size or quantization.",
        None,
    ),
}
_EXECUTOR_GAUGES = {
    "kv_blocks_used": ("kvserve_kv_blocks_used", "KV cache blocks in use on each executor.", None),
    "kv_blocks_total": ("kvserve_kv_blocks_total", "KV cache blocks each executor has.", None),
    "running": (
        "kvserve_running_requests",
        "Requests running on each executor.",
        "vllm:num_requests_running",
    ),
    "waiting": (
        "kvserve_waiting_requests",
        "Requests waiting on each executor.",
        "vllm:num_requests_waiting",
    ),
    "kv_host_blocks_used": (
        "kvserve_kv_host_blocks_used",
        "Host tier slots holding a block on each executor.",
        None,
    ),
    "kv_host_blocks_total": (
        "kvserve_kv_host_blocks_total",
        "Host tier slots each executor has (0: no host tier).",
        None,
    ),
    "kv_disk_blocks_used": (
        "kvserve_kv_disk_blocks_used",
        "Disk tier slots holding a block file on each executor.",
        None,
    ),
    "kv_disk_blocks_total": (
        "kvserve_kv_disk_blocks_total",
        "Disk tier slots each executor has (0: no disk tier).",
        None,
    ),
}
_EXECUTOR_HISTOGRAMS = {
    "queue_time": (
        "kvserve_queue_time_seconds",
        "Time requests waited on an executor between arriving and their first scheduled step.",
        "vllm:request_queue_time_seconds",
    ),
    "time_to_first_token": (
        "kvserve_executor_time_to_first_token_seconds",
        "Time from a request arriving at an executor to its first token there (the gateway's own "
        "kvserve_time_to_first_token_seconds adds tokenizing, routing and the network).",
        "vllm:time_to_first_token_seconds",
    ),
    "e2e_request_latency": (
        "kvserve_executor_e2e_request_latency_seconds",
        "Time from a request arriving at an executor to its end there.",
        "vllm:e2e_request_latency_seconds",
    ),
    "kv_pull_seconds": (
        "kvserve_kv_pull_duration_seconds",
        "Time each KV pull from a peer took, asked to last block delivered (or given up).",
        None,
    ),
}
# KV blocks used / total, under both of vLLM's names (gpu_cache_usage_perc is the older): a fraction, 1 = full
_VLLM_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_VLLM_LABELS = ["executor", "model_name"]


class ExecutorStatsCollector:
    """Yields the executors' series from the snapshot read from Redis just before rendering: kvserve's names
    labelled by executor, and each again under vLLM's name (labelled by executor and model_name too) for
    dashboards and tools that read vLLM's."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot: dict[str, ExecutorStats] = {}

    def collect(self):
        for field, (name, text, vllm) in _EXECUTOR_COUNTERS.items():
            for metric in filter(None, (name, vllm)):
                yield self._family(CounterMetricFamily, metric, text, lambda s, f=field: (s.counters[f],))
        for field, (name, text, vllm) in _EXECUTOR_GAUGES.items():
            for metric in filter(None, (name, vllm)):
                yield self._family(GaugeMetricFamily, metric, text, lambda s, f=field: (s.gauges[f],))
        for metric in _VLLM_KV_USAGE:
            text = "KV cache usage: blocks used / blocks total (1 = full)."
            yield self._family(GaugeMetricFamily, metric, text, lambda s: (_kv_usage(s),))
        for field, (name, text, vllm) in _EXECUTOR_HISTOGRAMS.items():
            for metric in filter(None, (name, vllm)):
                yield self._family(HistogramMetricFamily, metric, text, lambda s, f=field: _buckets(s, f))

    def _family(self, kind, metric: str, text: str, values):
        """values(stats): add_metric's arguments after the labels, for each executor's stats."""
        vllm = metric.startswith("vllm:")
        family = kind(metric, text, labels=_VLLM_LABELS if vllm else ["executor"])
        for executor_id, stats in self.snapshot.items():
            family.add_metric([executor_id, self.model_name] if vllm else [executor_id], *values(stats))
        return family


def _buckets(stats: ExecutorStats, field: str) -> tuple[list[tuple[str, int]], float]:
    histogram = stats.histograms[field]
    bounds = [str(b) for b in histogram.bounds] + ["+Inf"]
    return list(zip(bounds, histogram.buckets, strict=True)), histogram.sum


def _kv_usage(stats: ExecutorStats) -> float:
    total = stats.gauges["kv_blocks_total"]
    return stats.gauges["kv_blocks_used"] / total if total else 0.0


# the token counters' labels: a LoRA adapter's name has the tenant's bounded cardinality, since only the operator
# registers adapters (--lora-modules, POST /v1/load_lora_adapter) and a request naming another is refused unlabelled
_BY_ADAPTER = ["tenant", "adapter"]


class GatewayMetrics:
    def __init__(self, model_name: str) -> None:
        """model_name: the name this gateway serves, the executors' vLLM-named series' model_name label."""
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvserve_requests",
            'HTTP completion requests answered, by tenant, endpoint, status code and LoRA adapter ("": the base '
            "model, or a request refused before its model was known).",
            ["tenant", "endpoint", "status", "adapter"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "kvserve_prompt_tokens", "Prompt tokens of requests served.", _BY_ADAPTER, registry=self.registry
        )
        self.prompt_tokens_cached = Counter(
            "kvserve_prompt_tokens_cached",
            "Prompt tokens whose KV came from an executor's prefix cache (not computed).",
            _BY_ADAPTER,
            registry=self.registry,
        )
        self.prompt_tokens_computed = Counter(
            "kvserve_prompt_tokens_computed",
            "Prompt tokens an executor computed (prefilled): prompt tokens less cached ones.",
            _BY_ADAPTER,
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
            "kvserve_generation_tokens", "Tokens generated.", _BY_ADAPTER, registry=self.registry
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
        self.executors = ExecutorStatsCollector(model_name)
        self.registry.register(self.executors)
        self.redis_memory = RedisMemoryCollector()  # its snapshot set by the gateway before each render
        self.registry.register(self.redis_memory)

    def first_token(self, gateway_ttft_s: float, executor_ttft_s: float | None, held_s: float = 0.0) -> None:
        """held_s: time the request waited at the gateway for an executor with room, a queue rather than the
        gateway's own work, so it is left out of the added latency."""
        self.ttft.observe(gateway_ttft_s)
        self.queue_time.observe(held_s)
        if executor_ttft_s is not None:
            self.added_latency.observe(max(0.0, gateway_ttft_s - executor_ttft_s - held_s))

    def count_usage(
        self, tenant: str, adapter: str, prompt_tokens: int, cached_tokens: int, kv_block_seconds: float
    ) -> None:
        """What an ended request used, as its tenant's usage hash counts it (gateway.tenants.rate_limits);
        adapter: its LoRA adapter's name, "" for the base model."""
        self.prompt_tokens.labels(tenant, adapter).inc(prompt_tokens)
        self.prompt_tokens_cached.labels(tenant, adapter).inc(cached_tokens)
        self.prompt_tokens_computed.labels(tenant, adapter).inc(max(0, prompt_tokens - cached_tokens))
        self.kv_block_seconds.labels(tenant).inc(kv_block_seconds)

    def tokens_arrived(self, tenant: str, adapter: str, count: int, gap_s: float | None) -> None:
        """count new tokens in one update, gap_s after the previous update (None for the first)."""
        self.generation_tokens.labels(tenant, adapter).inc(count)
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
