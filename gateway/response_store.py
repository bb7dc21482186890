"""Stored responses (/v1/responses with `store`, GET and DELETE /v1/responses/{id}, previous_response_id): kept in
Redis per tenant, so every gateway replica finds what another stored, and no tenant reaches another's.

A record is one JSON string {"response": the Response object, "items": the conversation's items, input then output},
under a key that names its tenant: a request can only name keys of its own caller's tenant, so another tenant's id
reads as absent (404). Each record expires after --responses-ttl. Per tenant the records are counted and weighed in
an index (a sorted set by creation time and a hash of sizes); a new record over the tenant's count or bytes evicts
that tenant's oldest ones, as a cache does, rather than refusing new work. A conversation whose items outgrow
--responses-max-bytes is refused with a 400 before it is generated.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis

from gateway.api_error import APIError, invalid_request
from gateway.limit_flags import add_limit_flags, read_limit_flags
from gateway.openai.responses_api import RESPONSE_ID
from gateway.redis_clock import REDIS_NOW


@dataclass(slots=True, frozen=True)
class StoreLimits:
    ttl_s: int = 24 * 3600  # OpenAI keeps 30 days; a Redis holds less: a day serves a conversation
    max_bytes: int = 1024 * 1024  # one conversation's items, as JSON, before its output is added
    max_per_tenant: int = 10_000
    max_tenant_bytes: int = 256 * 1024 * 1024


DEFAULT_STORE_LIMITS = StoreLimits()

_FLAGS = {
    "ttl_s": ("--responses-ttl", "seconds a stored response is kept"),
    "max_bytes": (
        "--responses-max-bytes",
        "bytes of one conversation's items (JSON) a stored response may hold; a longer one is refused",
    ),
    "max_per_tenant": ("--responses-max-per-tenant", "stored responses per tenant; the oldest are evicted"),
    "max_tenant_bytes": (
        "--responses-max-tenant-bytes",
        "bytes of stored responses per tenant; the oldest are evicted",
    ),
}


def add_response_store_args(parser: argparse.ArgumentParser) -> None:
    title = "stored responses (/v1/responses, kept in Redis per tenant)"
    add_limit_flags(parser, title, DEFAULT_STORE_LIMITS, _FLAGS, dest_prefix="responses_")


def store_limits(args: argparse.Namespace) -> StoreLimits:
    return read_limit_flags(StoreLimits, args, dest_prefix="responses_")


def record_key(tenant: str, response_id: str) -> str:
    return f"kvserve:responses:{tenant}:{response_id}"


def _index_key(tenant: str) -> str:
    return f"kvserve:responses:{tenant}"  # a record's key adds ":resp_...", so none is this


def _sizes_key(tenant: str) -> str:
    return f"kvserve:responses:{tenant}:sizes"  # "sizes" is no response id


_TOTAL = "total"  # the sizes hash's sum, beside one field per response id

_FORGET = """
local function forget(id)
  local size = tonumber(redis.call('HGET', KEYS[3], id) or '0')
  redis.call('HDEL', KEYS[3], id)
  redis.call('HINCRBY', KEYS[3], 'total', -size)
  redis.call('ZREM', KEYS[2], id)
  redis.call('DEL', ARGV[1] .. id)
end
"""

# KEYS: the record, the tenant's index, its sizes. ARGV: the record key's prefix, the response id, the record,
# ttl, max count, max bytes. Saving twice (a retried command) counts once: the old size is taken back first.
_SAVE = (
    REDIS_NOW
    + _FORGET
    + """
local prefix, id, record = ARGV[1], ARGV[2], ARGV[3]
local ttl, max_count, max_bytes = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
for _, old in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - ttl)) do forget(old) end
forget(id)
redis.call('SET', KEYS[1], record, 'EX', ttl)
redis.call('ZADD', KEYS[2], now, id)
redis.call('HSET', KEYS[3], id, #record)
local total = redis.call('HINCRBY', KEYS[3], 'total', #record)
local count = redis.call('ZCARD', KEYS[2])
local evicted = 0
while count > 1 and (count > max_count or total > max_bytes) do
  forget(redis.call('ZRANGE', KEYS[2], 0, 0)[1])
  total = tonumber(redis.call('HGET', KEYS[3], 'total'))
  count = count - 1
  evicted = evicted + 1
end
redis.call('EXPIRE', KEYS[2], ttl)
redis.call('EXPIRE', KEYS[3], ttl)
return evicted
"""
)

# KEYS: the record, the tenant's index, its sizes. ARGV: the record key's prefix, the response id. 1 if it existed.
_DELETE = (
    _FORGET
    + """
local existed = redis.call('EXISTS', KEYS[1])
forget(ARGV[2])
return existed
"""
)


def _unreachable(error: Exception) -> APIError:
    return APIError(503, f"the response store (Redis) is unreachable: {error}", "server_error")


class ResponseStore:
    def __init__(self, client: aioredis.Redis, limits: StoreLimits = DEFAULT_STORE_LIMITS) -> None:
        self.client = client
        self.limits = limits
        self._save = client.register_script(_SAVE)
        self._delete = client.register_script(_DELETE)

    def _keys(self, tenant: str, response_id: str) -> list[str]:
        return [record_key(tenant, response_id), _index_key(tenant), _sizes_key(tenant)]

    async def load(self, tenant: str, response_id: str) -> dict | None:
        """{"response", "items"}, or None when this tenant has no such response (any more)."""
        if not RESPONSE_ID.fullmatch(response_id):
            return None
        try:
            record = await self.client.get(record_key(tenant, response_id))
        except redis.RedisError as error:
            raise _unreachable(error) from None
        return None if record is None else json.loads(record)

    def check_size(self, items: list[dict]) -> None:
        """Before generating: a conversation too large to store is refused, not answered and then forgotten."""
        size = len(json.dumps(items, ensure_ascii=False).encode())
        if size > self.limits.max_bytes:
            raise invalid_request(
                f"input: the conversation (with the previous response's) is {size} bytes, over this server's limit "
                f"of {self.limits.max_bytes} for a stored response (--responses-max-bytes); start a new "
                "conversation, or send store: false",
                "input",
            )

    async def save(self, tenant: str, response: dict, items: list[dict]) -> int:
        """Store it; returns how many of the tenant's oldest responses it evicted."""
        record = json.dumps({"response": response, "items": items}, ensure_ascii=False, separators=(",", ":"))
        limits = self.limits
        args = [record_key(tenant, ""), response["id"], record, limits.ttl_s, limits.max_per_tenant]
        return int(await self._save(self._keys(tenant, response["id"]), [*args, limits.max_tenant_bytes]))

    async def delete(self, tenant: str, response_id: str) -> bool:
        if not RESPONSE_ID.fullmatch(response_id):
            return False
        try:
            deleted = await self._delete(
                self._keys(tenant, response_id), [record_key(tenant, ""), response_id]
            )
        except redis.RedisError as error:
            raise _unreachable(error) from None
        return bool(deleted)
