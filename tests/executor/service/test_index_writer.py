import time

import pytest
import redis

from executor.kv.block_pool import BlockPool
from executor.service.index_writer import IndexWriter, connect
from shared import redis_keys as keys
from shared.executor_stats import ExecutorStats
from tests.processes import eventually

LOAD = {"running": 1, "waiting": 0, "kv_usage": 0.5}


def held(client: redis.Redis, executor_id: str, tier: str | None = None) -> set[str]:
    """The hashes the executor's blocks set (its pool's, or the tier's) holds, which it marks as complete."""
    key = keys.blocks_key(executor_id) if tier is None else keys.tier_key(executor_id, tier)
    members = client.smembers(key)
    assert keys.BLOCKS_MARKER in members
    return members - {keys.BLOCKS_MARKER}


def test_register_publish_deregister(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.sadd(keys.blocks_key("reg-a"), "left-by-an-earlier-run")
    index = IndexWriter(client, "reg-a")
    index.register({"address": "tcp://127.0.0.1:1", "block_size": 16})
    assert client.hget(keys.executor_key("reg-a"), "block_size") == "16"
    assert "reg-a" in client.smembers(keys.EXECUTORS)
    assert held(client, "reg-a") == set()  # what an earlier run left is gone
    # a scrape sees the executor, at zero, from the start; and its stats expire with it
    assert ExecutorStats.from_hash(client.hgetall(keys.stats_key("reg-a"))) == ExecutorStats()
    assert 0 < client.ttl(keys.stats_key("reg-a")) <= keys.HEARTBEAT_TTL_S

    index.publish([b"\x01", b"\x02"], [], LOAD)
    index.publish([b"\x03"], [b"\x01"], LOAD)
    assert held(client, "reg-a") == {"02", "03"}
    assert client.hget(keys.load_key("reg-a"), "running") == "1"
    assert all(0 < client.ttl(k) <= keys.HEARTBEAT_TTL_S for k in keys.executor_keys("reg-a"))

    client.delete(keys.executor_key("reg-a"))  # expired during a stall: the next heartbeat brings it back
    index.publish([], [], LOAD, heartbeat=True)
    assert client.hget(keys.executor_key("reg-a"), "address") == "tcp://127.0.0.1:1"

    index.deregister()
    assert "reg-a" not in client.smembers(keys.EXECUTORS)
    assert not any(client.exists(k) for k in keys.executor_keys("reg-a"))


def test_stats_go_out_with_the_load_and_wait_out_a_failure(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    index = IndexWriter(client, "reg-c")
    index.register({"address": "tcp://127.0.0.1:3"})
    stats = ExecutorStats()
    stats.counters["prefix_cache_hit_tokens"] = 32
    stats.observe_queue_time(0.02)
    index.publish([], [], LOAD, stats=stats.to_hash())
    assert ExecutorStats.from_hash(client.hgetall(keys.stats_key("reg-c"))) == stats

    index.publish([], [], LOAD)  # no stats given: the last ones stay
    assert ExecutorStats.from_hash(client.hgetall(keys.stats_key("reg-c"))) == stats

    index.client = connect("redis://127.0.0.1:1/0")  # Redis unreachable
    stats.counters["prefix_cache_hit_tokens"] = 64
    index.publish([], [], LOAD, stats=stats.to_hash())
    index.client = client
    index.publish([], [], LOAD, heartbeat=True)  # the newest stats that failed to go out go now
    assert client.hget(keys.stats_key("reg-c"), "prefix_cache_hit_tokens") == "64"
    index.deregister()
    assert not client.exists(keys.stats_key("reg-c"))


def test_a_step_that_changes_nothing_a_reader_sees_makes_no_round_trip(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    index = IndexWriter(client, "reg-d")
    index.register({"address": "tcp://127.0.0.1:4"})
    index.publish([], [], LOAD)
    client.delete(keys.load_key("reg-d"))  # a write now would bring it back
    index.publish([], [], dict(LOAD))
    assert not client.exists(keys.load_key("reg-d"))
    index.publish([], [], {**LOAD, "kv_usage": 0.75})  # the load moved
    assert client.hget(keys.load_key("reg-d"), "kv_usage") == "0.75"
    client.delete(keys.load_key("reg-d"))
    index.publish([b"\x0d"], [], {**LOAD, "kv_usage": 0.75})  # a block cached
    assert held(client, "reg-d") == {"0d"} and client.exists(keys.load_key("reg-d"))
    client.delete(keys.load_key("reg-d"))
    index.publish([], [], {**LOAD, "kv_usage": 0.75}, heartbeat=True)  # a heartbeat writes all of it
    assert client.hget(keys.load_key("reg-d"), "running") == "1"
    index.deregister()


def test_changes_that_failed_to_publish_go_out_with_the_next_write(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    index = IndexWriter(client, "reg-b")
    index.register({"address": "tcp://127.0.0.1:2"})
    index.publish([b"\x0a"], [], LOAD)

    index.client = connect("redis://127.0.0.1:1/0")  # Redis unreachable
    started = time.monotonic()
    index.publish([b"\x0b"], [b"\x0a"], LOAD)  # logged, kept, not raised
    assert time.monotonic() - started < 1  # no retries with backoff inside the engine loop
    index.client = client
    index.publish([b"\x0c"], [], LOAD)  # while failing, only heartbeats try Redis
    assert held(client, "reg-b") == {"0a"}
    index.publish([], [], LOAD, heartbeat=True)
    assert held(client, "reg-b") == {"0b", "0c"}
    index.deregister()


def test_executor_ids_cannot_alias_other_keys():

    for bad in ("a:blocks", "", "a b"):
        with pytest.raises(ValueError, match="executor_id"):
            keys.check_executor_id(bad)


def _cache(pool: BlockPool, hashes: list[bytes]) -> list:
    blocks = pool.allocate(len(hashes))
    for block, block_hash in zip(blocks, hashes, strict=True):
        pool.cache(block, block_hash)
    return blocks


@pytest.mark.parametrize("loss", ["restart", "eviction"])
def test_blocks_redis_lost_are_republished_whole_from_the_pool(redis_url, loss):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    pool = BlockPool(3, record_events=True)
    index = IndexWriter(client, f"reg-lost-{loss}", cached_hashes=pool.cached_hashes)
    index.register({"address": "tcp://127.0.0.1:4"})
    first = _cache(pool, [b"\x01", b"\x02", b"\x03"])
    index.publish(*pool.drain_events(), LOAD)
    pool.free(first)

    if loss == "restart":  # what a Redis that restarted empty holds
        client.flushdb()
    else:
        client.delete(keys.blocks_key(index.executor_id))
    _cache(pool, [b"\x04", b"\x05"])  # evicts \x01 and \x02 (least recently freed) on the way
    index.publish(*pool.drain_events(), LOAD)  # only the changes: the rest stays lost
    assert client.smembers(keys.blocks_key(index.executor_id)) == {"04", "05"}
    index.publish(*pool.drain_events(), LOAD, heartbeat=True)  # notices the marker is gone
    assert client.hget(keys.executor_key(index.executor_id), "address") == "tcp://127.0.0.1:4"
    index.publish(*pool.drain_events(), LOAD)  # the whole pool's cache, as it is now
    assert held(client, index.executor_id) == {"03", "04", "05"}
    assert ExecutorStats.from_hash(client.hgetall(keys.stats_key(index.executor_id))) == ExecutorStats()
    assert all(0 < client.ttl(k) <= keys.HEARTBEAT_TTL_S for k in keys.executor_keys(index.executor_id))

    index.publish(*pool.drain_events(), LOAD, heartbeat=True)  # whole again: nothing more to write
    index.publish([], [b"\x05"], LOAD)
    assert held(client, index.executor_id) == {"03", "04"}
    index.deregister()


def test_the_heartbeat_thread_notices_a_lost_set_for_the_engine_loop(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    pool = BlockPool(4, record_events=True)
    index = IndexWriter(client, "reg-thread", cached_hashes=pool.cached_hashes)
    index.register({"address": "tcp://127.0.0.1:5"})
    _cache(pool, [b"\x0a", b"\x0b"])
    index.publish(*pool.drain_events(), LOAD)
    index.start_heartbeat()
    try:
        client.flushdb()
        registration = keys.executor_key(index.executor_id)
        assert eventually(lambda: client.exists(registration), timeout=3 * keys.HEARTBEAT_INTERVAL_S)
        assert eventually(lambda: index.sets["pool"].lost.is_set(), timeout=1)
        index.publish(*pool.drain_events(), LOAD)  # the engine loop's next step
        assert held(client, index.executor_id) == {"0a", "0b"}
    finally:
        index.deregister()


def test_writes_go_through_at_once_after_redis_dropped_every_connection(redis_url):
    """What a Redis restart leaves in the pool: connections the server closed. The first write on each used
    to fail, and a failed write waits for the next heartbeat."""
    client = connect(redis_url)
    index = IndexWriter(client, "reg-stale")
    index.register({"address": "tcp://127.0.0.1:6"})
    index.publish([b"\x01"], [], LOAD)
    redis.Redis.from_url(redis_url).client_kill_filter(_type="normal", skipme=True)
    index.publish([b"\x02"], [], LOAD)
    assert held(redis.Redis.from_url(redis_url, decode_responses=True), "reg-stale") == {"01", "02"}
    index.deregister()


def test_a_peer_has_room_only_when_another_live_executor_could_start_a_request_now():
    from kvserve.redis_server import start_redis_server

    server = start_redis_server()  # of its own: no other test's executor may count as a peer
    client = redis.Redis.from_url(server.url, decode_responses=True)
    own, peer = IndexWriter(client, "room-own"), IndexWriter(client, "room-peer")
    own.register({"address": "tcp://127.0.0.1:1", "block_size": 16})
    try:
        assert not own.check_peers()  # alone: nowhere better to go
        peer.register({"address": "tcp://127.0.0.1:2", "block_size": 16})
        peer.publish([], [], {"running": 4, "waiting": 2, "queue_full": 0})
        assert not own.check_peers()  # the peer has a queue of its own
        peer.publish([], [], {"running": 4, "waiting": 16, "queue_full": 1})
        assert not own.check_peers()
        peer.publish([], [], {"running": 1, "waiting": 0, "queue_full": 0})
        assert own.check_peers()
        own.publish([], [], {"running": 9, "waiting": 9, "queue_full": 1})
        assert own.check_peers()  # its own load does not count
        client.delete(keys.executor_key("room-peer"))  # the peer's heartbeat expired: dead
        assert not own.check_peers()
    finally:
        client.close()
        server.stop()


class Tiers:
    """Two KV tiers' indexes as the engine would hand them over: each step's events, and all they hold."""

    def __init__(self) -> None:
        self.pools = {"host": BlockPool(4, record_events=True), "disk": BlockPool(8, record_events=True)}

    def events(self) -> dict[str, tuple[list[bytes], list[bytes]]]:
        return {name: pool.drain_events() for name, pool in self.pools.items()}

    def hashes(self) -> dict[str, list[bytes]]:
        return {name: list(pool.cached_hashes()) for name, pool in self.pools.items()}


def test_tier_sets_are_published_beside_the_pools_and_expire_with_it(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    tiers = Tiers()
    _cache(tiers.pools["disk"], [b"\xd0"])  # found on disk at start-up, before registering
    tiers.pools["disk"].drain_events()
    index = IndexWriter(client, "reg-tiers", tier_hashes=tiers.hashes)
    index.register({"address": "tcp://127.0.0.1:7", "kv_transfer_address": "tcp://127.0.0.1:8"})
    index.publish([b"\x01"], [], LOAD, tiers=tiers.events())  # the first publish writes the tiers whole
    assert held(client, "reg-tiers") == {"01"}
    assert held(client, "reg-tiers", "host") == set() and held(client, "reg-tiers", "disk") == {"d0"}

    host = _cache(tiers.pools["host"], [b"\x01", b"\x02"])
    _cache(tiers.pools["disk"], [b"\x01"])
    index.publish([], [b"\x01"], LOAD, tiers=tiers.events())  # the pool evicted what the tiers kept
    assert held(client, "reg-tiers") == set()
    assert held(client, "reg-tiers", "host") == {"01", "02"}
    assert held(client, "reg-tiers", "disk") == {"d0", "01"}
    tiers.pools["host"].free(host)
    _cache(tiers.pools["host"], [b"\x03", b"\x04", b"\x05"])  # evicts one of the freed on its way
    index.publish([], [], LOAD, tiers=tiers.events())
    assert held(client, "reg-tiers", "host") == {h.hex() for h in tiers.pools["host"].cached_hashes()}
    assert len(held(client, "reg-tiers", "host")) == 4
    assert all(0 < client.ttl(k) <= keys.HEARTBEAT_TTL_S for k in keys.executor_keys("reg-tiers"))
    assert {keys.tier_key("reg-tiers", t) for t in keys.TIERS} <= set(keys.executor_keys("reg-tiers"))

    index.deregister()
    assert not any(client.exists(keys.tier_key("reg-tiers", t)) for t in keys.TIERS)


@pytest.mark.parametrize("loss", ["restart", "eviction"])
def test_tier_sets_redis_lost_are_republished_whole_from_the_tiers(redis_url, loss):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    tiers = Tiers()
    executor_id = f"reg-tier-lost-{loss}"
    index = IndexWriter(client, executor_id, tier_hashes=tiers.hashes)
    index.register({"address": "tcp://127.0.0.1:9"})
    _cache(tiers.pools["host"], [b"\x0a", b"\x0b"])
    _cache(tiers.pools["disk"], [b"\x0a", b"\x0b", b"\x0c"])
    index.publish([b"\x0a"], [], LOAD, tiers=tiers.events())

    if loss == "restart":
        client.flushdb()
    else:  # only the disk set evicted: the others stay as they are
        client.delete(keys.tier_key(executor_id, "disk"))
    _cache(tiers.pools["disk"], [b"\x0d"])
    index.publish([], [], LOAD, tiers=tiers.events())  # only the changes: the rest stays lost
    assert client.smembers(keys.tier_key(executor_id, "disk")) == {"0d"}
    index.publish([], [], LOAD, heartbeat=True, tiers=tiers.events())  # notices the markers are gone
    lost = {name for name, block_set in index.sets.items() if block_set.lost.is_set()}
    assert lost == ({"pool", "host", "disk"} if loss == "restart" else {"disk"})
    index.publish([], [], LOAD, tiers=tiers.events())
    assert held(client, executor_id, "disk") == {"0a", "0b", "0c", "0d"}
    assert held(client, executor_id, "host") == {"0a", "0b"}
    assert all(0 < client.ttl(k) <= keys.HEARTBEAT_TTL_S for k in keys.executor_keys(executor_id))
    index.deregister()
