"""Stored responses (/v1/responses with `store`, GET and DELETE /v1/responses/{id}, previous_response_id): kept in
Redis per tenant, so every gateway replica finds what another stored, and no tenant reaches another's.

A record is one JSON string {"response": the Response object, "items": the conversation's items, input then output},
under a key that names its tenant: a request can only name keys of its own caller's tenant, so another tenant's id
reads as absent (404). Each record expires after --responses-ttl. Per tenant the records are counted and weighed in
an index (a sorted set by creation time and a hash of sizes); a new record over the tenant's count or bytes evicts
that tenant's oldest ones, as a cache does, rather than refusing new work. A conversation whose items outgrow
--responses-max-bytes is refused with a 400 before it is generated.

All tenants' records together are bounded too (--responses-max-total-bytes), so busy tenants cannot fill Redis: a
second index (every record key by its expiry time, and a hash of sizes with their sum) counts every record, updated
by the same script that writes, evicts or deletes it, so the bound holds across gateways. Redis expires a record's
key on its own; its bytes leave the sum when a later script finds its expiry passed. The bound never evicts another
tenant's records: a store it refuses is a 507 before generation (the store is full now), or, when others filled it
while the answer was generated, an answer that is not stored (its later GET is a 404), as when Redis fails.
"""

from __future__ import annotations

import argparse
import functools
import json
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis

from gateway.api_error import APIError, invalid_request
from gateway.limit_flags import add_limit_flags, read_limit_flags
from gateway.openai.responses_api import RESPONSE_ID
from gateway.prompt.workers import PromptWorkers
from gateway.redis_clock import REDIS_NOW


@dataclass(slots=True, frozen=True)
class StoreLimits:
    ttl_s: int = 24 * 3600  # OpenAI keeps 30 days; a Redis holds less: a day serves a conversation
    max_bytes: int = 1024 * 1024  # one conversation's items, as JSON, before its output is added
    max_per_tenant: int = 10_000
    max_tenant_bytes: int = 256 * 1024 * 1024
    # every tenant's together: below the Redis maxmemory the deployments set (1 GiB), beside API keys and indexes
    max_total_bytes: int = 512 * 1024 * 1024


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
    "max_total_bytes": (
        "--responses-max-total-bytes",
        "bytes of stored responses of all tenants together; past it a store is refused (507), none evicted",
    ),
}

# every tenant's records, by expiry time; and their sizes, with their sum in the field "total" (no record key)
EXPIRIES_KEY = "kvserve:responses-all:expiries"
SIZES_KEY = "kvserve:responses-all:sizes"
# records whose expiry passed taken out of the sum per script: bounded work, while every save takes out up to this
# many, more than the one it adds, so the sum keeps up with expiries
_PRUNE = 256


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


# KEYS (every script): the record, the tenant's index, its sizes, all records' expiries, their sizes.
# Both forgets are idempotent (each reads its own size), so a record taken out by either is never counted twice.
_FORGET = f"""
local function unstore(key)
  local size = redis.call('HGET', KEYS[5], key)
  if size then
    redis.call('HDEL', KEYS[5], key)
    redis.call('HINCRBY', KEYS[5], 'total', -tonumber(size))
  end
  redis.call('ZREM', KEYS[4], key)
end

local function forget(id)
  local size = tonumber(redis.call('HGET', KEYS[3], id) or '0')
  redis.call('HDEL', KEYS[3], id)
  redis.call('HINCRBY', KEYS[3], 'total', -size)
  redis.call('ZREM', KEYS[2], id)
  unstore(ARGV[1] .. id)
  redis.call('DEL', ARGV[1] .. id)
end

local function prune_expired()
  for _, key in ipairs(redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now, 'LIMIT', 0, {_PRUNE})) do
    unstore(key)
  end
end
"""

# ARGV: the record key's prefix, the response id, the record, ttl, max count, max tenant bytes, max total bytes, the
# record's size, 1 to only check. Saving twice (a retried command) counts once: the old size is taken back. The
# tenant's own oldest records its bounds evict are taken out first; if all tenants' records would then still pass
# the total, nothing is stored and it returns -1; else the count evicted (a check: 0, and nothing stored).
# The shebang: a Redis at its maxmemory refuses the whole script up front (an unflagged script, once its first
# write passed, may go on writing past maxmemory).
_SAVE = (
    "#!lua\n"
    + REDIS_NOW
    + _FORGET
    + """
local prefix, id, record = ARGV[1], ARGV[2], ARGV[3]
local ttl, max_count, max_bytes = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local max_total, size, check = tonumber(ARGV[7]), tonumber(ARGV[8]), ARGV[9] == '1'
prune_expired()
for _, old in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - ttl)) do forget(old) end
local function sized(hash, field) return tonumber(redis.call('HGET', hash, field) or '0') end
local again = redis.call('HEXISTS', KEYS[3], id) == 1
local count = redis.call('ZCARD', KEYS[2]) + (again and 0 or 1)
local tenant_bytes = sized(KEYS[3], 'total') - sized(KEYS[3], id) + size
local total = sized(KEYS[5], 'total') - sized(KEYS[5], prefix .. id) + size
local evicted, rank = {}, 0
while count > 1 and (count > max_count or tenant_bytes > max_bytes) do
  local oldest = redis.call('ZRANGE', KEYS[2], rank, rank)[1]
  rank = rank + 1
  if oldest ~= id then
    evicted[#evicted + 1] = oldest
    tenant_bytes = tenant_bytes - sized(KEYS[3], oldest)
    total = total - sized(KEYS[5], prefix .. oldest)
    count = count - 1
  end
end
if total > max_total then return -1 end
if check then return 0 end
forget(id)
for _, old in ipairs(evicted) do forget(old) end
redis.call('SET', KEYS[1], record, 'EX', ttl)
redis.call('ZADD', KEYS[2], now, id)
redis.call('HSET', KEYS[3], id, size)
redis.call('HINCRBY', KEYS[3], 'total', size)
redis.call('ZADD', KEYS[4], now + ttl, KEYS[1])
redis.call('HSET', KEYS[5], KEYS[1], size)
redis.call('HINCRBY', KEYS[5], 'total', size)
redis.call('EXPIRE', KEYS[2], ttl)
redis.call('EXPIRE', KEYS[3], ttl)
return #evicted
"""
)

# ARGV: the record key's prefix, the response id. 1 if it existed. allow-oom: a Redis at its maxmemory refuses
# writes (noeviction), and a delete is how a tenant frees room there.
_DELETE = (
    "#!lua flags=allow-oom\n"
    + REDIS_NOW
    + _FORGET
    + """
local existed = redis.call('EXISTS', KEYS[1])
forget(ARGV[2])
prune_expired()
return existed
"""
)


def _store_error(error: Exception) -> APIError:
    return APIError(503, f"the response store (Redis) is unreachable: {error}", "server_error")


class StoreFull(Exception):
    """All tenants' stored responses are at --responses-max-total-bytes."""


def store_full(limits: StoreLimits) -> APIError:
    return APIError(
        507,
        f"the response store is full: this server keeps at most {limits.max_total_bytes} bytes of stored responses "
        "for all its users (--responses-max-total-bytes); send store: false, delete stored responses, or retry "
        "later, as older ones expire",
        "server_error",
        param="store",
        code="response_store_full",
    )


def _response_json(record: bytes) -> bytes:
    response = json.loads(record)["response"]
    return json.dumps(response, ensure_ascii=False, separators=(",", ":")).encode()


class ResponseStore:
    def __init__(self, client: aioredis.Redis, limits: StoreLimits, workers: PromptWorkers) -> None:
        self.client = client
        self.limits = limits
        # a record weighs up to --responses-max-bytes: a large one is decoded where the event loop goes on serving
        self.workers = workers
        self._save = client.register_script(_SAVE)
        self._delete = client.register_script(_DELETE)

    def _keys(self, tenant: str, response_id: str) -> list[str]:
        return [
            record_key(tenant, response_id),
            _index_key(tenant),
            _sizes_key(tenant),
            EXPIRIES_KEY,
            SIZES_KEY,
        ]

    async def _read(self, tenant: str, response_id: str) -> bytes | None:
        if not RESPONSE_ID.fullmatch(response_id):
            return None
        try:
            return await self.client.get(record_key(tenant, response_id))
        except redis.RedisError as error:
            raise _store_error(error) from None

    async def load(self, tenant: str, response_id: str) -> dict | None:
        """{"response", "items"}, or None when this tenant has no such response (any more)."""
        record = await self._read(tenant, response_id)
        if record is None:
            return None
        return await self.workers.run(functools.partial(json.loads, record), len(record))

    async def load_response(self, tenant: str, response_id: str) -> bytes | None:
        """The Response object alone, as JSON (GET /v1/responses/{id}); None as load's."""
        record = await self._read(tenant, response_id)
        if record is None:
            return None
        return await self.workers.run(functools.partial(_response_json, record), len(record))

    def check_size(self, items: list[dict]) -> int:
        """Before generating: a conversation too large to store is refused, not answered and then forgotten.
        Returns its size, the least its record will weigh."""
        size = len(json.dumps(items, ensure_ascii=False).encode())
        if size > self.limits.max_bytes:
            raise invalid_request(
                f"input: the conversation (with the previous response's) is {size} bytes, over this server's limit "
                f"of {self.limits.max_bytes} for a stored response (--responses-max-bytes); start a new "
                "conversation, or send store: false",
                "input",
            )
        return size

    async def check_room(self, tenant: str, size: int) -> None:
        """Before generating: a 507 if a record of size would not fit under all tenants' bound now."""
        try:
            fits = await self._run_save(tenant, "", b"", size, check=True) >= 0
        except redis.RedisError as error:
            raise _store_error(error) from None
        if not fits:
            raise store_full(self.limits)

    async def save(self, tenant: str, response: dict, items: list[dict]) -> int:
        """Store it; returns how many of the tenant's oldest responses it evicted. StoreFull: all tenants' bound
        left no room for it, and nothing changed."""
        record = json.dumps(
            {"response": response, "items": items}, ensure_ascii=False, separators=(",", ":")
        ).encode()
        evicted = await self._run_save(tenant, response["id"], record, len(record), check=False)
        if evicted < 0:
            raise StoreFull(
                f"{len(record)} bytes past --responses-max-total-bytes {self.limits.max_total_bytes}"
            )
        return evicted

    async def _run_save(self, tenant: str, response_id: str, record: bytes, size: int, check: bool) -> int:
        limits = self.limits
        args = [record_key(tenant, ""), response_id, record, limits.ttl_s, limits.max_per_tenant]
        args += [limits.max_tenant_bytes, limits.max_total_bytes, size, int(check)]
        return int(await self._save(self._keys(tenant, response_id), args))

    async def delete(self, tenant: str, response_id: str) -> bool:
        if not RESPONSE_ID.fullmatch(response_id):
            return False
        try:
            deleted = await self._delete(
                self._keys(tenant, response_id), [record_key(tenant, ""), response_id]
            )
        except redis.RedisError as error:
            raise _store_error(error) from None
        return bool(deleted)

    async def stored_bytes(self) -> int:
        """All tenants' stored responses, as the bound counts them (expired ones until a script takes them out)."""
        return int(await self.client.hget(SIZES_KEY, "total") or 0)
