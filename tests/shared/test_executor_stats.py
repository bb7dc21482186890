from shared.executor_stats import COUNTERS, GAUGES, HISTOGRAMS, ExecutorStats

TIER_COUNTERS = (
    *("kv_cached_tokens_pool", "kv_cached_tokens_host", "kv_cached_tokens_disk", "kv_cached_tokens_peer"),
    *("kv_offloaded_bytes_host", "kv_offloaded_bytes_disk", "kv_loaded_bytes_host", "kv_loaded_bytes_disk"),
    *("kv_pulled_bytes", "kv_pulls", "kv_pulls_failed", "kv_disk_files_rejected"),
)
TIER_GAUGES = ("kv_host_blocks_used", "kv_host_blocks_total", "kv_disk_blocks_used", "kv_disk_blocks_total")


def test_every_series_round_trips_through_the_redis_hash():
    stats = ExecutorStats()
    for i, name in enumerate(COUNTERS):
        stats.counters[name] = float(i + 1)
    for i, name in enumerate(GAUGES):
        stats.gauges[name] = float(100 + i)
    stats.histograms["kv_pull_seconds"].observe(0.004)
    stats.histograms["kv_pull_seconds"].observe(12.0)
    stats.observe_queue_time(0.02)
    # Redis hands back bytes keys and values
    raw = {name.encode(): str(value).encode() for name, value in stats.to_hash().items()}
    back = ExecutorStats.from_hash(raw)
    assert back.counters == stats.counters
    assert back.gauges == stats.gauges
    for name in HISTOGRAMS:
        assert back.histograms[name].buckets == stats.histograms[name].buckets, name
        assert back.histograms[name].sum == stats.histograms[name].sum, name


def test_kv_tiers_series_are_published():
    assert set(TIER_COUNTERS) <= set(COUNTERS)
    assert set(TIER_GAUGES) <= set(GAUGES)
    pull = ExecutorStats().histograms["kv_pull_seconds"]
    assert (pull.bounds[0], pull.bounds[-1]) == (0.001, 30.0)
    pull.observe(0.004)
    pull.observe(60.0)  # past the last bound: only +Inf counts it
    assert pull.buckets[0] == 0 and pull.buckets[-2] == 1 and pull.buckets[-1] == 2


def test_an_older_executors_hash_reads_its_missing_tier_series_as_zero():
    stats = ExecutorStats.from_hash({b"preemptions": b"2"})
    assert stats.counters["preemptions"] == 2.0
    assert all(stats.counters[name] == 0.0 for name in TIER_COUNTERS)
    assert all(stats.gauges[name] == 0.0 for name in TIER_GAUGES)
    assert stats.histograms["kv_pull_seconds"].buckets[-1] == 0
