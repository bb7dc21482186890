"""Stored responses in a real Redis: per tenant, bounded by count and bytes (the oldest evicted), expiring."""

from __future__ import annotations

import argparse
import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from gateway.api_error import APIError
from gateway.response_store import ResponseStore, StoreLimits, add_response_store_args, store_limits


def _response() -> dict:
    return {"id": "resp_" + uuid.uuid4().hex, "object": "response", "output": []}


def _run(redis_url: str, limits: StoreLimits, work):
    async def main():
        client = aioredis.from_url(redis_url)
        try:
            return await work(ResponseStore(client, limits))
        finally:
            await client.aclose()

    return asyncio.run(main())


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
    store = ResponseStore(aioredis.from_url(redis_url), StoreLimits(max_bytes=100))
    store.check_size([{"type": "message", "role": "user", "content": "short"}])
    with pytest.raises(APIError) as caught:
        store.check_size([{"type": "message", "role": "user", "content": "x" * 100}])
    assert caught.value.status == 400 and "--responses-max-bytes" in caught.value.message


def test_store_limits_are_flags():
    parser = argparse.ArgumentParser()
    add_response_store_args(parser)
    limits = store_limits(parser.parse_args(["--responses-ttl", "60", "--responses-max-per-tenant", "3"]))
    assert limits == StoreLimits(ttl_s=60, max_per_tenant=3)
    with pytest.raises(SystemExit):
        parser.parse_args(["--responses-max-bytes", "0"])
