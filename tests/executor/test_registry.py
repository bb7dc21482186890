import time

import pytest
import redis

from executor.registry import Registry, connect
from shared import redis_keys as keys
from shared.executor_stats import ExecutorStats

LOAD = {"running": 1, "waiting": 0, "kv_usage": 0.5}


def test_register_publish_deregister(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.sadd(keys.blocks_key("reg-a"), "left-by-an-earlier-run")
    registry = Registry(client, "reg-a")
    registry.register({"address": "tcp://127.0.0.1:1", "block_size": 16})
    assert client.hget(keys.executor_key("reg-a"), "block_size") == "16"
    assert "reg-a" in client.smembers(keys.EXECUTORS)
    assert not client.exists(keys.blocks_key("reg-a"))
    # a scrape sees the executor, at zero, from the start; and its stats expire with it
    assert ExecutorStats.from_hash(client.hgetall(keys.stats_key("reg-a"))) == ExecutorStats()
    assert 0 < client.ttl(keys.stats_key("reg-a")) <= keys.HEARTBEAT_TTL_S

    registry.publish([b"\x01", b"\x02"], [], LOAD)
    registry.publish([b"\x03"], [b"\x01"], LOAD)
    assert client.smembers(keys.blocks_key("reg-a")) == {"02", "03"}
    assert client.hget(keys.load_key("reg-a"), "running") == "1"
    assert all(0 < client.ttl(k) <= keys.HEARTBEAT_TTL_S for k in keys.executor_keys("reg-a"))

    client.delete(keys.executor_key("reg-a"))  # expired during a stall: the next heartbeat brings it back
    registry.publish([], [], LOAD, heartbeat=True)
    assert client.hget(keys.executor_key("reg-a"), "address") == "tcp://127.0.0.1:1"

    registry.deregister()
    assert "reg-a" not in client.smembers(keys.EXECUTORS)
    assert not any(client.exists(k) for k in keys.executor_keys("reg-a"))


def test_stats_go_out_with_the_load_and_wait_out_a_failure(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    registry = Registry(client, "reg-c")
    registry.register({"address": "tcp://127.0.0.1:3"})
    stats = ExecutorStats()
    stats.counters["prefix_cache_hit_tokens"] = 32
    stats.observe_queue_time(0.02)
    registry.publish([], [], LOAD, stats=stats.to_hash())
    assert ExecutorStats.from_hash(client.hgetall(keys.stats_key("reg-c"))) == stats

    registry.publish([], [], LOAD)  # no stats given: the last ones stay
    assert ExecutorStats.from_hash(client.hgetall(keys.stats_key("reg-c"))) == stats

    registry.client = connect("redis://127.0.0.1:1/0")  # Redis unreachable
    stats.counters["prefix_cache_hit_tokens"] = 64
    registry.publish([], [], LOAD, stats=stats.to_hash())
    registry.client = client
    registry.publish([], [], LOAD, heartbeat=True)  # the newest stats that failed to go out go now
    assert client.hget(keys.stats_key("reg-c"), "prefix_cache_hit_tokens") == "64"
    registry.deregister()
    assert not client.exists(keys.stats_key("reg-c"))


def test_changes_that_failed_to_publish_go_out_with_the_next_write(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    registry = Registry(client, "reg-b")
    registry.register({"address": "tcp://127.0.0.1:2"})
    registry.publish([b"\x0a"], [], LOAD)

    registry.client = connect("redis://127.0.0.1:1/0")  # Redis unreachable
    started = time.monotonic()
    registry.publish([b"\x0b"], [b"\x0a"], LOAD)  # logged, kept, not raised
    assert time.monotonic() - started < 1  # no retries with backoff inside the engine loop
    registry.client = client
    registry.publish([b"\x0c"], [], LOAD)  # while failing, only heartbeats try Redis
    assert client.smembers(keys.blocks_key("reg-b")) == {"0a"}
    registry.publish([], [], LOAD, heartbeat=True)
    assert client.smembers(keys.blocks_key("reg-b")) == {"0b", "0c"}
    registry.deregister()


def test_executor_ids_cannot_alias_other_keys():

    for bad in ("a:blocks", "", "a b"):
        with pytest.raises(ValueError, match="executor_id"):
            keys.check_executor_id(bad)
