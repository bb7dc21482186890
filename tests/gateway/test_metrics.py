from gateway.telemetry.metrics import GatewayMetrics
from shared.executor_stats import COUNTERS, ExecutorStats


def test_executor_counters_render_under_their_prometheus_names():
    # as a gateway reads an executor's stats hash back from Redis
    stats = ExecutorStats.from_hash({b"block_hash_mismatches": b"3", b"preemptions": b"2"})
    page = GatewayMetrics().render({"e1": stats}).decode()
    assert 'kvserve_block_hash_mismatches_total{executor="e1"} 3.0' in page
    assert 'kvserve_preemptions_total{executor="e1"} 2.0' in page
    # every counter an executor publishes reaches /metrics, as a counter
    counters = [line.split()[2] for line in page.splitlines() if line.endswith(" counter")]
    executor_counters = [name for name in counters if f'{name}{{executor="e1"}}' in page]
    assert len(executor_counters) == len(COUNTERS)


def test_a_tenants_usage_renders_as_counters_labelled_by_tenant():
    metrics = GatewayMetrics()
    metrics.count_usage("acme", prompt_tokens=40, cached_tokens=32, kv_block_seconds=0.5)
    metrics.count_usage("acme", prompt_tokens=10, cached_tokens=0, kv_block_seconds=0.25)
    page = metrics.render({}).decode()
    assert 'kvserve_prompt_tokens_total{tenant="acme"} 50.0' in page
    assert 'kvserve_prompt_tokens_cached_total{tenant="acme"} 32.0' in page
    assert 'kvserve_prompt_tokens_computed_total{tenant="acme"} 18.0' in page
    assert 'kvserve_kv_block_seconds_total{tenant="acme"} 0.75' in page
