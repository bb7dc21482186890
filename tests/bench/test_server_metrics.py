import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from bench.server_metrics import (
    ADDED_LATENCY,
    added_latency_summary,
    histogram_buckets,
    histogram_quantile,
)
from gateway.telemetry.metrics import GatewayMetrics


def _exposition(observations: list[float], buckets=(0.001, 0.002, 0.005, 0.01)) -> str:
    registry = CollectorRegistry()
    histogram = Histogram(ADDED_LATENCY, "test", buckets=buckets, registry=registry)
    for value in observations:
        histogram.observe(value)
    return generate_latest(registry).decode()


def test_quantiles_interpolate_inside_the_bucket_like_prometheus():
    buckets = histogram_buckets(_exposition([0.0015] * 4 + [0.004] * 4 + [0.02] * 2), ADDED_LATENCY)
    assert buckets == {0.001: 0, 0.002: 4, 0.005: 8, 0.01: 8, float("inf"): 10}
    # rank 5 of 10 lies 1/4 of the way through the (2 ms, 5 ms] bucket, which holds observations 5-8
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.00275)
    assert histogram_quantile(0.4, buckets) == pytest.approx(0.002)
    assert histogram_quantile(0.95, buckets) == pytest.approx(0.01)  # past the last finite bound
    assert histogram_quantile(0.5, {0.001: 0, float("inf"): 0}) is None


def test_a_run_is_isolated_from_earlier_requests_by_subtracting_the_scrape_before_it():
    before = histogram_buckets(_exposition([0.009] * 100), ADDED_LATENCY)
    after = histogram_buckets(_exposition([0.009] * 100 + [0.0015] * 3 + [0.004]), ADDED_LATENCY)
    summary = added_latency_summary(after, before)
    assert summary["count"] == 4
    assert summary["share_within_5ms"] == 1.0
    assert 1.0 < summary["p50_ms"] < 2.0  # without the subtraction it would sit near 9 ms
    assert added_latency_summary(before, before) is None  # no request in between


def test_servers_without_the_metric_yield_none():
    assert histogram_buckets("<html>not prometheus</html>", ADDED_LATENCY) is None
    assert histogram_buckets(_exposition([0.1]), "other_metric_seconds") is None
    assert added_latency_summary(None, None) is None


def test_the_gateway_records_its_share_of_time_to_first_token():
    metrics = GatewayMetrics("tiny")
    metrics.first_token(0.2505, 0.248)  # 2.5 ms of it were the gateway's
    metrics.first_token(0.100, None)  # no executor span known: only the TTFT is recorded
    text = metrics.render({}).decode()
    buckets = histogram_buckets(text, ADDED_LATENCY)
    assert buckets[0.002] == 0 and buckets[0.003] == 1 and buckets[float("inf")] == 1
    ttft = histogram_buckets(text, "kvserve_time_to_first_token_seconds")
    assert ttft[float("inf")] == 2
