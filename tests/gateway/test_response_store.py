"""Stored responses in a real Redis: per tenant, bounded by count and bytes (the oldest evicted), expiring; all
tenants together bounded by bytes (refused, none evicted), the bound's count kept by saves, deletes and expiry."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import uuid

import pytest
import redis
import redis.asyncio as aioredis

from gateway.api_error import APIError
from gateway.prompt.workers import PromptWorkers
from gateway.response_store import (
    ResponseStore,
    StoreFull,
    StoreLimits,
    add_response_store_args,
    store_limits,
)
from kvserve.redis_server import start_redis_server


def _response() -> dict:
    return {"id": "resp_" + uuid.uuid4().hex, "object": "response", "output": []}


def _run(redis_url: str, limits: StoreLimits, work):
    async def main():
        client = aioredis.from_url(redis_url)
        workers = PromptWorkers()
        try:
            return await work(ResponseStore(client, limits, workers))
        finally:
            workers.close()
            await client.aclose()

    return asyncio.run(main())


@pytest.fixture
def own_redis_url():
    """A Redis of the test's own: the total bound counts every tenant's records in it."""
    server = start_redis_server()
    yield server.url
    server.stop()


def test_tenants_apart_and_oldest_evicted_by_count_and_bytes(redis_url):
    tenant, other = f"t-{uuid.uuid4().hex[:8]}", f"u-{uuid.uuid4().hex[:8]}"
    items = [{"type": "message", "role": "user", "content": "x" * 300}]

    async def work(store: ResponseStore):
        saved = [_response() for _ in range(4)]
        for response in saved:
            await store.save(tenant, response, items)
        await store.save(tenant, saved[-1], items)  # saved again (a retried command): counted once
        kept = [await store.load(tenant, r["id"]) is not None for r in saved]
        theirs = await store.load(other, saved[-1]["id"])
        refused_delete = await store.delete(other, saved[-1]["id"])
        deleted = await store.delete(tenant, saved[-1]["id"])
        # bytes: one record is ~400 bytes, the tenant may hold 1000: saving two more leaves the newest two
        store.limits = StoreLimits(max_per_tenant=10, max_tenant_bytes=1000)
        newer = [_response() for _ in range(2)]
        for response in newer:
            await store.save(tenant, response, items)
        after = [await store.load(tenant, r["id"]) is not None for r in [*saved[:3], *newer]]
        return kept, theirs, refused_delete, deleted, after

    kept, theirs, refused_delete, deleted, after = _run(redis_url, StoreLimits(max_per_tenant=3), work)
    assert kept == [False, True, True, True]
    assert theirs is None and not refused_delete and deleted
    assert after == [False, False, False, True, True]


def test_records_expire_and_oversized_conversations_refused(redis_url):
    tenant = f"t-{uuid.uuid4().hex[:8]}"

    async def work(store: ResponseStore):
        response = _response()
        await store.save(tenant, response, [])
        found = (await store.load(tenant, response["id"]))["response"] == response
        await asyncio.sleep(2.2)
        return found, await store.load(tenant, response["id"])

    found, expired = _run(redis_url, StoreLimits(ttl_s=2), work)
    assert found and expired is None
    store = ResponseStore(
        aioredis.from_url(redis_url), StoreLimits(max_bytes=100), PromptWorkers(inline_bytes=0)
    )
    store.check_size([{"type": "message", "role": "user", "content": "short"}])
    with pytest.raises(APIError) as caught:
        store.check_size([{"type": "message", "role": "user", "content": "x" * 100}])
    assert caught.value.status == 400 and "--responses-max-bytes" in caught.value.message


def test_store_limits_are_flags():
    parser = argparse.ArgumentParser()
    add_response_store_args(parser)
    flags = [
        "--responses-ttl",
        "60",
        "--responses-max-per-tenant",
        "3",
        "--responses-max-total-bytes",
        "9000",
    ]
    limits = store_limits(parser.parse_args(flags))
    assert limits == StoreLimits(ttl_s=60, max_per_tenant=3, max_total_bytes=9000)
    with pytest.raises(SystemExit):
        parser.parse_args(["--responses-max-bytes", "0"])


ITEMS = [{"type": "message", "role": "user", "content": "x" * 300}]  # a record of about 400 bytes


def test_all_tenants_bounded_together_refused_past_it_and_freed_by_delete(own_redis_url):
    first, second = f"t-{uuid.uuid4().hex[:8]}", f"u-{uuid.uuid4().hex[:8]}"

    async def work(store: ResponseStore):
        kept = [_response() for _ in range(2)]
        for response in kept:  # ~800 of the 1000 bytes
            await store.save(first, response, ITEMS)
        before = await store.stored_bytes()
        refused = []
        for tenant in (
            second,
            first,
        ):  # neither fits: another's records are not evicted, nor the tenant's own
            response = _response()
            with pytest.raises(StoreFull):
                await store.save(tenant, response, ITEMS)
            refused.append(await store.load(tenant, response["id"]))
        with pytest.raises(APIError) as full:
            await store.check_room(second, 300)
        unchanged = await store.stored_bytes() == before and all(
            [await store.load(first, r["id"]) for r in kept]
        )
        await store.delete(first, kept[0]["id"])
        freed = await store.stored_bytes()
        await store.check_room(second, 300)
        admitted = _response()
        await store.save(second, admitted, ITEMS)
        return before, refused, full.value, unchanged, freed, await store.load(second, admitted["id"])

    limits = StoreLimits(max_total_bytes=1000)
    before, refused, full, unchanged, freed, admitted = _run(own_redis_url, limits, work)
    assert 700 < before <= 1000 and refused == [None, None] and unchanged
    assert (
        full.status == 507
        and full.code == "response_store_full"
        and "--responses-max-total-bytes" in full.message
    )
    assert freed == before // 2 and admitted is not None


def test_a_tenants_own_eviction_makes_its_room_and_a_retried_save_counts_once(own_redis_url):
    tenant = f"t-{uuid.uuid4().hex[:8]}"

    async def work(store: ResponseStore):
        saved = [_response() for _ in range(3)]
        for response in saved:  # at its own bound of two, and at all tenants' of ~900 bytes: it rolls its own
            await store.save(tenant, response, ITEMS)
            await store.save(tenant, response, ITEMS)
        return [await store.load(tenant, r["id"]) is not None for r in saved], await store.stored_bytes()

    kept, stored = _run(own_redis_url, StoreLimits(max_per_tenant=2, max_total_bytes=900), work)
    assert kept == [False, True, True] and 700 < stored <= 900


def test_expired_records_leave_the_total(own_redis_url):
    tenant = f"t-{uuid.uuid4().hex[:8]}"

    async def work(store: ResponseStore):
        await store.save(tenant, _response(), ITEMS)
        await store.save(tenant, _response(), ITEMS)
        with pytest.raises(StoreFull):
            await store.save(tenant, _response(), ITEMS)
        await asyncio.sleep(2.2)  # both expired: Redis dropped their keys, and the next script their bytes
        await store.check_room(tenant, 300)
        return await store.stored_bytes()

    assert _run(own_redis_url, StoreLimits(ttl_s=2, max_total_bytes=900), work) == 0


def test_a_large_record_is_decoded_in_a_worker_thread(redis_url):
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    threads = []

    class Recording(PromptWorkers):
        """The real pool, noting the thread each piece of work ran on."""

        async def run(self, work, size):
            def noted():
                threads.append(threading.current_thread().name)
                return work()

            return await super().run(noted, size)

    async def main():
        client = aioredis.from_url(redis_url)
        workers = Recording()
        try:
            store = ResponseStore(client, StoreLimits(), workers)
            response = _response()
            await store.save(
                tenant, response, [{"type": "message", "role": "user", "content": "y" * 100_000}]
            )
            loaded = await store.load(tenant, response["id"])
            return loaded["response"] == response and json.loads(
                await store.load_response(tenant, response["id"])
            )
        finally:
            workers.close()
            await client.aclose()

    assert asyncio.run(main())
    assert len(threads) == 2 and all(name.startswith("kvserve-prompt") for name in threads), threads


def test_a_redis_at_its_maxmemory_refuses_stores_but_deletes_free_room(own_redis_url):
    """noeviction, as the deployments set it: writes past maxmemory fail, a delete still runs."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"

    async def work(store: ResponseStore):
        saved = _response()
        await store.save(tenant, saved, [{"type": "message", "role": "user", "content": "z" * 200_000}])
        used = (await store.client.info("memory"))["used_memory"]
        await store.client.config_set("maxmemory-policy", "noeviction")
        await store.client.config_set("maxmemory", used - 100_000)
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            await store.save(tenant, _response(), ITEMS)
        deleted = await store.delete(tenant, saved["id"])
        return deleted, await store.stored_bytes()

    assert _run(own_redis_url, StoreLimits(), work) == (True, 0)
