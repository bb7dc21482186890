"""The routing view read from a real Redis: one round trip, however long the prompt."""

from __future__ import annotations

import asyncio
import hashlib
import uuid

import redis

from gateway.routing.cost import DISK, HOST, POOL
from gateway.routing.index_reader import IndexReader
from shared import redis_keys
from tests.gateway.lost_reply import LosesAReply, losing_replies


def routing_view(redis_url: str, hashes: list[bytes]):
    """One read of the routing view, by a reader of its own."""

    async def view():
        reader = IndexReader(redis_url)
        try:
            return await reader.routing_view(hashes)
        finally:
            await reader.close()

    return asyncio.run(view())


def test_a_prompt_of_more_blocks_than_lua_unpacks_at_once(redis_url):
    """12,000 block hashes (Lua's unpack stops near 8,000): the leading run is counted across the runs the
    script asks in, and a prompt no executor could hold is the context check's to refuse, not a 503 here."""
    executor_id = f"reader-{uuid.uuid4().hex[:8]}"
    hashes = [hashlib.sha256(str(i).encode()).digest() for i in range(12_000)]
    client = redis.Redis.from_url(redis_url)
    info = {"address": "tcp://127.0.0.1:1", "model": "m", "block_size": 16, "max_model_len": 2048}
    client.hset(redis_keys.executor_key(executor_id), mapping=info)
    client.sadd(redis_keys.blocks_key(executor_id), *(h.hex() for h in hashes[:9_000]))
    client.sadd(redis_keys.EXECUTORS, executor_id)

    try:
        (found,) = [load for info, load in routing_view(redis_url, hashes) if info.executor_id == executor_id]
        assert found.cached_blocks == 9_000
    finally:
        client.srem(redis_keys.EXECUTORS, executor_id)
        client.delete(redis_keys.executor_key(executor_id), redis_keys.blocks_key(executor_id))


def test_an_in_flight_change_retried_after_its_reply_was_lost_applies_once(redis_url):
    executor_id = f"inflight-{uuid.uuid4().hex[:8]}"
    key = redis_keys.inflight_key(executor_id)

    async def run():
        reader = IndexReader(redis_url)
        losing_replies(reader.redis)
        try:
            await reader.add_inflight(executor_id, 1)  # its script loaded: the armed reply is the change's
            LosesAReply.armed = True
            await reader.add_inflight(executor_id, 100)
            assert not LosesAReply.armed  # the reply was lost, and the change retried
            LosesAReply.armed = True
            await reader.add_inflight(executor_id, -1)
            assert not LosesAReply.armed
        finally:
            await reader.close()

    try:
        asyncio.run(run())
        assert int(redis.Redis.from_url(redis_url).get(key)) == 100
    finally:
        redis.Redis.from_url(redis_url).delete(key)


def test_the_view_gives_each_leading_block_the_best_tier_holding_it(redis_url):
    """Pool before host before disk, up to the first block held nowhere, across the runs the script asks in
    (the first 5,000 blocks span two); and the registration's KV transfer fields."""
    executor_id = f"tiers-{uuid.uuid4().hex[:8]}"
    hashes = [hashlib.sha256(f"tier {i}".encode()).digest() for i in range(5_010)]
    hexes = [h.hex() for h in hashes]
    client = redis.Redis.from_url(redis_url)
    info = {
        "address": "tcp://127.0.0.1:1",
        "model": "m",
        "block_size": 16,
        "max_model_len": 2048,
        "kv_transfer_address": "tcp://127.0.0.1:2",
        "kv_fingerprint": "ab" * 16,
    }
    client.hset(redis_keys.executor_key(executor_id), mapping=info)
    client.sadd(
        redis_keys.blocks_key(executor_id), redis_keys.BLOCKS_MARKER, hexes[0], hexes[2], hexes[5_001]
    )
    client.sadd(redis_keys.tier_key(executor_id, "host"), *hexes[:3], *hexes[3:5_000:2], hexes[5_002])
    client.sadd(redis_keys.tier_key(executor_id, "disk"), *hexes[1:5_002], hexes[5_003], *hexes[5_005:])
    client.sadd(redis_keys.EXECUTORS, executor_id)

    try:
        ((found_info, found),) = [
            pair for pair in routing_view(redis_url, hashes) if pair[0].executor_id == executor_id
        ]
        expected = [POOL, HOST, POOL] + [HOST if i % 2 else DISK for i in range(3, 5_000)]
        expected += [DISK, POOL, HOST, DISK]  # 5,004 is held nowhere: the run stops there
        assert found.held == tuple(expected) and found.cached_blocks == 5_004
        assert (found_info.kv_transfer_address, found_info.kv_fingerprint) == ("tcp://127.0.0.1:2", "ab" * 16)
    finally:
        client.srem(redis_keys.EXECUTORS, executor_id)
        client.delete(*redis_keys.executor_keys(executor_id))


def test_the_view_reads_each_executors_lora_adapters_and_their_residency(redis_url):
    """What an executor with --enable-lora publishes (executor/cli.py, EngineStats.load) is what routing reads; a
    registration whose lora_adapters is not a JSON object serves no adapter instead of failing every request."""
    ids = [f"lora-{uuid.uuid4().hex[:8]}" for _ in range(3)]
    client = redis.Redis.from_url(redis_url)
    base = {"address": "tcp://127.0.0.1:1", "model": "m", "block_size": 16, "max_model_len": 2048}
    registrations = [
        {
            **base,
            "lora_adapters": '{"sql": "d1", "chat": "d2"}',
            "lora_refused": '{"bad": {"path": "/a/bad", "error": "no config"}}',
        },
        {**base, "lora_adapters": "[not an object"},
        base,
    ]
    for executor_id, info in zip(ids, registrations, strict=True):
        client.hset(redis_keys.executor_key(executor_id), mapping=info)
        client.sadd(redis_keys.EXECUTORS, executor_id)
    client.hset(redis_keys.load_key(ids[0]), mapping={"lora_running": "sql", "lora_held": "sql,chat"})
    try:
        view = {info.executor_id: (info, load) for info, load in routing_view(redis_url, [])}
        info, load = view[ids[0]]
        assert info.lora and info.lora_adapters == {"sql": "d1", "chat": "d2"}
        assert info.lora_refused == {"bad": ("/a/bad", "no config")}
        assert load.lora_running == {"sql"} and load.lora_held == {"sql", "chat"}
        assert view[ids[1]][0].lora and view[ids[1]][0].lora_adapters == {}
        assert not view[ids[2]][0].lora and view[ids[2]][1].lora_held == frozenset()
    finally:
        client.srem(redis_keys.EXECUTORS, *ids)
        client.delete(*(redis_keys.executor_key(i) for i in ids), redis_keys.load_key(ids[0]))
