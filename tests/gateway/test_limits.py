import asyncio
import secrets
import time

import pytest
import redis
import redis.asyncio as aioredis

from gateway.routing.index_reader import connect
from gateway.tenants.api_keys import KeyRecord, KeyStore
from gateway.tenants.rate_limits import Limiter
from shared import redis_keys as keys
from tests.gateway.lost_reply import LosesAReply, losing_replies


def _record(tenant: str = "limits", **limits) -> KeyRecord:
    """A key of its own for each test: limit state lives under the key id."""
    fields = {"rpm": None, "tpm": None, "max_concurrency": None, **limits}
    return KeyRecord(secrets.token_hex(8), tenant, "salt", **fields, models=None, created_at=time.time())


def _level(redis_url: str, record: KeyRecord, kind: str) -> float:
    return float(redis.Redis.from_url(redis_url).hget(keys.limit_key(record.key_id, kind), "level"))


def _run(redis_url: str, body, lease_s: float = Limiter.LEASE_S):
    """Run body(limiter) on a fresh asyncio connection."""

    async def run():
        async with aioredis.from_url(redis_url) as client:
            limiter = Limiter(client)
            limiter.LEASE_S = lease_s
            return await body(limiter)

    return asyncio.run(run())


def test_requests_per_minute(redis_url):
    record = _record(rpm=3)

    async def body(limiter):
        for i in range(3):
            assert (await limiter.admit(record, f"r{i}", 0)).admitted
        before = _level(redis_url, record, "rpm")
        refused = await limiter.admit(record, "r3", 0)
        assert not refused.admitted and refused.limit == "rpm"
        assert 19 < refused.retry_after_s <= 20  # one request refills in 60/3 s
        assert "requests per minute limit 3" in refused.message
        assert _level(redis_url, record, "rpm") == before  # the refusal consumed nothing

    _run(redis_url, body)
    ttl_ms = redis.Redis.from_url(redis_url).pttl(keys.limit_key(record.key_id, "rpm"))
    assert 60_000 < ttl_ms <= 61_000  # gone once it would be full again


def test_a_refusal_by_one_limit_consumes_none_of_the_others(redis_url):
    record = _record(rpm=10, tpm=100, max_concurrency=5)

    async def body(limiter):
        assert (await limiter.admit(record, "a", 90)).admitted
        rpm_before = _level(redis_url, record, "rpm")
        refused = await limiter.admit(record, "b", 50)
        assert (refused.admitted, refused.limit) == (False, "tpm")
        assert "tokens per minute limit 100" in refused.message
        assert _level(redis_url, record, "rpm") == rpm_before
        assert redis.Redis.from_url(redis_url).zrange(
            keys.limit_key(record.key_id, "concurrency"), 0, -1
        ) == [b"a"]

    _run(redis_url, body)


def test_tokens_per_minute_reserve_and_refund(redis_url):
    record = _record(tpm=600)  # refills 10 tokens a second

    async def body(limiter):
        assert (await limiter.admit(record, "a", 500)).admitted
        refused = await limiter.admit(record, "b", 300)
        assert (refused.admitted, refused.limit) == (False, "tpm")
        assert 19 < refused.retry_after_s <= 20  # 200 more tokens at 10 a second
        await limiter.release(record, "a", reserved_tokens=500, used_tokens=100)  # 400 come back
        assert _level(redis_url, record, "tpm") == pytest.approx(500, abs=2)
        assert (await limiter.admit(record, "b", 300)).admitted
        await limiter.release(record, "b", reserved_tokens=300, used_tokens=450)  # used more: charged
        assert _level(redis_url, record, "tpm") == pytest.approx(50, abs=2)
        await limiter.release(record, "c", reserved_tokens=5000, used_tokens=0)
        assert _level(redis_url, record, "tpm") == 600  # never past capacity

    _run(redis_url, body)


def test_a_request_bigger_than_the_budget_runs_alone_then_its_debt_blocks(redis_url):
    record = _record(tpm=100)

    async def body(limiter):
        assert (await limiter.admit(record, "big", 250)).admitted  # the bucket was full
        assert _level(redis_url, record, "tpm") == pytest.approx(-150, abs=1)
        small = await limiter.admit(record, "small", 10)
        assert (small.admitted, small.limit) == (False, "tpm")
        assert 95 < small.retry_after_s <= 96  # 160 tokens at 100 a minute
        again = await limiter.admit(record, "big2", 250)
        assert 149 < again.retry_after_s <= 150  # waits for a full bucket, not for 250

    _run(redis_url, body)
    ttl_ms = redis.Redis.from_url(redis_url).pttl(keys.limit_key(record.key_id, "tpm"))
    assert ttl_ms > 150_000  # the debt does not expire before it is paid back


def test_concurrency_slots(redis_url):
    record = _record(max_concurrency=2)

    async def body(limiter):
        assert (await limiter.admit(record, "a", 0)).admitted
        assert (await limiter.admit(record, "b", 0)).admitted
        refused = await limiter.admit(record, "c", 0)
        assert (refused.admitted, refused.limit, refused.retry_after_s) == (False, "max_concurrency", 1.0)
        assert "concurrent requests limit 2" in refused.message
        await limiter.release(record, "a", 0, 0)
        assert (await limiter.admit(record, "c", 0)).admitted

    _run(redis_url, body)


def test_leases_expire_unless_refreshed(redis_url):
    record = _record(max_concurrency=2)

    async def body(limiter):
        assert (await limiter.admit(record, "crashed", 0)).admitted  # its gateway dies: never released
        assert (await limiter.admit(record, "running", 0)).admitted
        assert not (await limiter.admit(record, "new", 0)).admitted
        await asyncio.sleep(0.6)
        await limiter.refresh([(record, "running"), (_record(), "unlimited")])
        await asyncio.sleep(0.6)  # "crashed" is past its lease, "running" is not
        assert (await limiter.admit(record, "new", 0)).admitted
        assert not (await limiter.admit(record, "another", 0)).admitted
        await limiter.release(record, "new", 0, 0)
        await limiter.refresh([(record, "new")])  # released: stays released
        assert (await limiter.admit(record, "another", 0)).admitted

    _run(redis_url, body, lease_s=1.0)


def test_two_gateways_share_one_budget(redis_url):
    record = _record(rpm=2, max_concurrency=3)

    async def body():
        async with aioredis.from_url(redis_url) as one, aioredis.from_url(redis_url) as two:
            first, second = Limiter(one), Limiter(two)
            assert (await first.admit(record, "a", 0)).admitted
            assert (await second.admit(record, "b", 0)).admitted
            assert (await first.admit(record, "c", 0)).limit == "rpm"
            assert (await second.admit(record, "c", 0)).limit == "rpm"

    asyncio.run(body())


def test_usage_is_counted_per_tenant(redis_url):
    tenant = f"usage-{secrets.token_hex(4)}"
    limited, unlimited = _record(tenant, tpm=1000), _record(tenant)

    async def body(limiter):
        await limiter.release(
            limited,
            "a",
            100,
            30,
            prompt_tokens=20,
            completion_tokens=10,
            cached_tokens=16,
            kv_block_seconds=0.25,
            cached_from={"host": 8},  # of the 16: the pool held the other 8
        )
        await limiter.release(
            unlimited,
            "b",
            0,
            0,
            prompt_tokens=5,
            completion_tokens=1,
            cached_tokens=4,
            cached_from={"peer": 4},
        )
        await limiter.count_kv_block_seconds(unlimited, "b", 1.5)  # an aborted request's, told after its end
        await limiter.count_rejected(limited, "refused")
        assert (await limiter.admit(unlimited, "c", 10**9)).admitted  # no limits: nothing to check

    _run(redis_url, body)
    usage = KeyStore(redis.Redis.from_url(redis_url)).usage(tenant)
    expected = {
        "requests": 2,
        "prompt_tokens": 25,
        "completion_tokens": 11,
        "cached_tokens": 16 + 4,
        # by where their KV came from, summing to cached_tokens
        "cached_tokens_pool": 8,
        "cached_tokens_host": 8,
        "cached_tokens_disk": 0,
        "cached_tokens_peer": 4,
        "computed_prompt_tokens": 4 + 1,
        "kv_block_seconds": 1.75,
        "rejected": 1,
    }
    assert usage == {tenant: expected}
    assert isinstance(usage[tenant]["kv_block_seconds"], float)


def test_a_write_retried_after_its_reply_was_lost_applies_once(redis_url):
    tenant = f"retried-{secrets.token_hex(4)}"
    record = _record(tenant, rpm=10, tpm=1000)

    async def body():
        client = losing_replies(connect(redis_url))
        limiter = Limiter(client)
        try:
            warm = _record(f"warm-{tenant}", rpm=10)  # its scripts loaded: an armed reply is the write's
            await limiter.admit(warm, "warm", 0)
            await limiter.release(warm, "warm", 0, 0)
            await limiter.count_rejected(warm, "warm")
            LosesAReply.armed = True
            assert (await limiter.admit(record, "request", 500)).admitted
            assert not LosesAReply.armed  # its reply was lost, and it was retried
            # taken once (twice: 8 and 0), give or take what refilled since (a sixtieth a second)
            assert _level(redis_url, record, "rpm") == pytest.approx(9, abs=0.5)
            assert _level(redis_url, record, "tpm") == pytest.approx(500, abs=100)
            LosesAReply.armed = True
            await limiter.release(record, "request", 500, 100, prompt_tokens=60, completion_tokens=40)
            assert not LosesAReply.armed  # its reply was lost, and it was retried
            LosesAReply.armed = True
            await limiter.count_rejected(record, "another")
            assert not LosesAReply.armed  # its reply was lost, and it was retried
            LosesAReply.armed = True
            await limiter.count_kv_block_seconds(record, "request", 2.5)
            assert not LosesAReply.armed  # its reply was lost, and it was retried
        finally:
            await client.aclose()

    asyncio.run(body())
    usage = KeyStore(redis.Redis.from_url(redis_url)).usage(tenant)[tenant]
    assert usage["requests"] == 1 and usage["prompt_tokens"] == 60 and usage["completion_tokens"] == 40
    assert usage["rejected"] == 1 and usage["kv_block_seconds"] == 2.5
