"""The gateway's Prometheus metrics: what it answered, and how long it took, with its own share split out.

Each Gateway owns a registry (several apps may live in one test process); /metrics renders it together with
every live executor's load, read from Redis at scrape time.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# seconds; fine at the low end, where the gateway's own overhead lives
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

EXECUTOR_GAUGES = {
    "running": "Requests running on each executor.",
    "waiting": "Requests waiting on each executor.",
    "kv_usage": "Share of each executor's KV blocks in use.",
}


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvserve_gateway_requests",
            "HTTP requests answered by this gateway.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "kvserve_gateway_tokens", "Tokens through this gateway.", ["kind"], registry=self.registry
        )
        self.ttft = Histogram(
            "kvserve_gateway_time_to_first_token_seconds",
            "Request arrival at the gateway to its first token leaving it.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.added_latency = Histogram(
            "kvserve_gateway_added_latency_seconds",
            "The gateway's own share of time to first token: its TTFT minus the span from handing the request "
            "to ZeroMQ to the first token coming back.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.executor_gauges = {
            name: Gauge(f"kvserve_executor_{name}", text, ["executor"], registry=self.registry)
            for name, text in EXECUTOR_GAUGES.items()
        }

    def first_token(self, gateway_ttft_s: float, executor_ttft_s: float | None) -> None:
        self.ttft.observe(gateway_ttft_s)
        if executor_ttft_s is not None:
            self.added_latency.observe(max(0.0, gateway_ttft_s - executor_ttft_s))

    def render(self, executor_loads: list) -> bytes:
        """Prometheus text; executor_loads are candidates with executor_id and the EXECUTOR_GAUGES fields."""
        for name, gauge in self.executor_gauges.items():
            gauge.clear()  # an executor gone since the last scrape must not linger
            for load in executor_loads:
                gauge.labels(executor=load.executor_id).set(getattr(load, name))
        return generate_latest(self.registry)
