from gateway.telemetry.metrics import GatewayMetrics
from shared.executor_stats import COUNTERS, ExecutorStats


def test_executor_counters_render_under_their_prometheus_names():
    # as a gateway reads an executor's stats hash back from Redis
    stats = ExecutorStats.from_hash({b"block_hash_mismatches": b"3", b"preemptions": b"2"})
    page = GatewayMetrics("tiny").render({"e1": stats}).decode()
    assert 'kvserve_block_hash_mismatches_total{executor="e1"} 3.0' in page
    assert 'kvserve_preemptions_total{executor="e1"} 2.0' in page
    # every counter an executor publishes reaches /metrics, as a counter
    counters = [line.split()[2] for line in page.splitlines() if line.endswith(" counter")]
    executor_counters = [name for name in counters if f'{name}{{executor="e1"}}' in page]
    assert len(executor_counters) == len(COUNTERS)


def test_a_tenants_usage_renders_as_counters_labelled_by_tenant_and_adapter():
    metrics = GatewayMetrics("tiny")
    metrics.count_usage("acme", "", prompt_tokens=40, cached_tokens=32, kv_block_seconds=0.5)
    metrics.count_usage("acme", "", prompt_tokens=10, cached_tokens=0, kv_block_seconds=0.25)
    metrics.count_usage("acme", "sql", prompt_tokens=7, cached_tokens=0, kv_block_seconds=0.25)
    metrics.tokens_arrived("acme", "sql", 3, None)
    lines = set(metrics.render({}).decode().splitlines())
    assert {
        'kvserve_prompt_tokens_total{adapter="",tenant="acme"} 50.0',
        'kvserve_prompt_tokens_cached_total{adapter="",tenant="acme"} 32.0',
        'kvserve_prompt_tokens_computed_total{adapter="",tenant="acme"} 18.0',
        'kvserve_prompt_tokens_total{adapter="sql",tenant="acme"} 7.0',
        'kvserve_generation_tokens_total{adapter="sql",tenant="acme"} 3.0',
        'kvserve_kv_block_seconds_total{tenant="acme"} 1.0',
    } <= lines


def test_each_executor_series_is_also_exported_under_vllms_name_with_the_same_values():
    from prometheus_client.parser import text_string_to_metric_families

    stats = ExecutorStats.from_hash(
        {"kv_blocks_used": 3, "kv_blocks_total": 12, "waiting": 2, "preemptions": 5}
    )
    stats.histograms["time_to_first_token"].observe(0.03)
    page = GatewayMetrics("tiny").render({"e1": stats}).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
    }
    vllm_labels = [dict(labels) for (name, labels) in samples if name.startswith("vllm:")]
    assert vllm_labels and all(
        (labels["executor"], labels["model_name"]) == ("e1", "tiny") for labels in vllm_labels
    )
    vllm = {name: value for (name, labels), value in samples.items() if name.startswith("vllm:")}
    twins = {
        "vllm:num_requests_waiting": "kvserve_waiting_requests",
        "vllm:num_preemptions_total": "kvserve_preemptions_total",
        "vllm:time_to_first_token_seconds_count": "kvserve_executor_time_to_first_token_seconds_count",
        "vllm:time_to_first_token_seconds_sum": "kvserve_executor_time_to_first_token_seconds_sum",
    }
    for vllm_name, kvserve_name in twins.items():
        assert vllm[vllm_name] == samples[(kvserve_name, (("executor", "e1"),))], vllm_name
    assert vllm["vllm:kv_cache_usage_perc"] == vllm["vllm:gpu_cache_usage_perc"] == 0.25
    # an executor whose pool size is not published yet reads as empty, not a division by zero
    page = GatewayMetrics("tiny").render({"e2": ExecutorStats()}).decode()
    assert 'vllm:kv_cache_usage_perc{executor="e2",model_name="tiny"} 0.0' in page


def test_kv_tier_series_render_per_executor():
    stats = ExecutorStats.from_hash(
        {b"kv_cached_tokens_host": b"64", b"kv_disk_blocks_total": b"800", b"kv_pulls_failed": b"1"}
    )
    stats.histograms["kv_pull_seconds"].observe(0.02)
    page = GatewayMetrics("tiny").render({"e1": stats}).decode()
    assert 'kvserve_kv_host_cached_tokens_total{executor="e1"} 64.0' in page
    assert 'kvserve_kv_pool_cached_tokens_total{executor="e1"} 0.0' in page
    assert 'kvserve_kv_disk_blocks_total{executor="e1"} 800.0' in page
    assert 'kvserve_kv_pulls_failed_total{executor="e1"} 1.0' in page
    assert 'kvserve_kv_pull_duration_seconds_bucket{executor="e1",le="0.025"} 1.0' in page
    assert 'kvserve_kv_pull_duration_seconds_bucket{executor="e1",le="0.01"} 0.0' in page
    # kvserve's own series only: vLLM has no names for them
    assert "vllm:kv_pull" not in page
