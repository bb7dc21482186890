"""Per-key rate limits shared by every gateway replica: requests per minute, tokens per minute, concurrency.

Each check-and-consume is one Lua script, so it is atomic across replicas, and it reads Redis's own clock
(TIME), since the gateways' clocks differ. A refused request consumes nothing. The minute limits are token
buckets that refill continuously; concurrency is a sorted set of request ids scored by lease expiry, so the
slots of a gateway that died free themselves after LEASE_S. Every state key expires once it would read the
same as a missing one (a full bucket, an empty set): idle keys cost nothing.

A command that meets a connection error is retried (gateway.routing.index_reader.connect), perhaps after Redis
ran it: each write here applies once per request id (gateway.routing.index_reader.APPLY_ONCE), so a retry neither
takes a budget twice nor counts usage twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway.redis_clock import REDIS_NOW
from gateway.routing.index_reader import APPLY_ONCE
from gateway.tenants.api_keys import ADAPTER_USAGE, ADAPTER_USAGE_COUNTERS, KeyRecord
from shared import redis_keys
from shared.cache_sources import by_source

# A bucket is a hash {level, at}: its level at server time `at`. It refills at capacity per minute up to
# capacity; a missing bucket is full. Levels may go below zero (a tpm debt).
_BUCKETS = """
local function level(key, capacity)
  local state = redis.call('HMGET', key, 'level', 'at')
  if not state[1] then return capacity end
  return math.min(capacity, tonumber(state[1]) + (now - tonumber(state[2])) * capacity / 60)
end

local function store(key, capacity, value)
  redis.call('HSET', key, 'level', value, 'at', now)
  redis.call('PEXPIRE', key, math.ceil((capacity - value) * 60000 / capacity) + 1000)
end
"""

# KEYS: rpm bucket, tpm bucket, concurrency set, the admission's marker. ARGV: rpm, tpm, max_concurrency
# (0: unlimited), tokens to reserve, request id, lease seconds. Returns {} when admitted, else {limit, seconds to
# wait} for the limit that needs the longest wait. Only an admission is marked: a refusal took nothing, so its
# retry may as well be admitted.
_ADMIT = (
    REDIS_NOW
    + _BUCKETS
    + """
if redis.call('EXISTS', KEYS[4]) == 1 then return {} end
local rpm, tpm, max_concurrency = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local reserve, request_id, lease = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local refused, wait = nil, 0
local function refuse(limit, seconds)
  if not refused or seconds > wait then refused, wait = limit, seconds end
end

local requests, tokens
if rpm > 0 then
  requests = level(KEYS[1], rpm)
  if requests < 1 then refuse('rpm', (1 - requests) * 60 / rpm) end
end
if tpm > 0 then
  tokens = level(KEYS[2], tpm)
  -- a request bigger than a whole minute's budget runs alone on a full bucket, taking it into debt
  if tokens < reserve and not (reserve > tpm and tokens >= tpm) then
    refuse('tpm', (math.min(reserve, tpm) - tokens) * 60 / tpm)
  end
end
if max_concurrency > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= max_concurrency then refuse('max_concurrency', 1) end
end
if refused then return {refused, tostring(wait)} end

if rpm > 0 then store(KEYS[1], rpm, requests - 1) end
if tpm > 0 then store(KEYS[2], tpm, tokens - reserve) end
if max_concurrency > 0 then
  redis.call('ZADD', KEYS[3], now + lease, request_id)
  redis.call('PEXPIRE', KEYS[3], math.ceil(lease * 1000) + 1000)
end
"""
    + f"""
redis.call('SET', KEYS[4], '1', 'EX', {redis_keys.APPLIED_TTL_S})
return {{}}
"""
)

# KEYS: tpm bucket, concurrency set, the tenant's usage hash, the release's marker. ARGV: tpm (0: unlimited),
# tokens to refund (negative: charge), request id, KV block-seconds, then integer usage counter names and amounts.
_RELEASE = (
    REDIS_NOW
    + _BUCKETS
    + APPLY_ONCE
    + """
local tpm, refund = tonumber(ARGV[1]), tonumber(ARGV[2])
if tpm > 0 and refund ~= 0 then store(KEYS[1], tpm, math.min(tpm, level(KEYS[1], tpm) + refund)) end
redis.call('ZREM', KEYS[2], ARGV[3])
if tonumber(ARGV[4]) ~= 0 then redis.call('HINCRBYFLOAT', KEYS[3], 'kv_block_seconds', ARGV[4]) end
for i = 5, #ARGV, 2 do redis.call('HINCRBY', KEYS[3], ARGV[i], ARGV[i + 1]) end
return 0
"""
)

# KEYS: the tenant's usage hash, the count's marker. ARGV: HINCRBY or HINCRBYFLOAT, the counter, the amount.
_COUNT = (
    APPLY_ONCE
    + """
redis.call(ARGV[1], KEYS[1], ARGV[2], ARGV[3])
return 0
"""
)

# KEYS: concurrency sets. ARGV: lease seconds, then the request id for each key. Only ids still present.
_REFRESH = (
    REDIS_NOW
    + """
local lease = tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  if redis.call('ZADD', key, 'XX', 'CH', now + lease, ARGV[i + 1]) == 1 then
    redis.call('PEXPIRE', key, math.ceil(lease * 1000) + 1000)
  end
end
return 0
"""
)


@dataclass(slots=True, frozen=True)
class Admission:
    admitted: bool
    limit: str | None = None  # which limit refused: "rpm" | "tpm" | "max_concurrency"
    retry_after_s: float = 0.0  # for the Retry-After header
    message: str = ""  # names the limit and its value


ADMITTED = Admission(True)


def _marker(record: KeyRecord, request_id: str, write: str) -> str:
    return redis_keys.applied_key(redis_keys.limit_key(record.key_id, f"request:{request_id}"), write)


def _refusal_message(record: KeyRecord, limit: str, reserve_tokens: int) -> str:
    if limit == "rpm":
        return f"requests per minute limit {record.rpm} reached for this API key"
    if limit == "tpm":
        return (
            f"tokens per minute limit {record.tpm} reached for this API key "
            f"(this request reserves {reserve_tokens}: prompt plus max_tokens)"
        )
    return f"concurrent requests limit {record.max_concurrency} reached for this API key"


class Limiter:
    LEASE_S = 60.0  # a concurrency slot expires unless refreshed (a dead gateway's slots heal)

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self._admit = client.register_script(_ADMIT)
        self._release = client.register_script(_RELEASE)
        self._refresh = client.register_script(_REFRESH)
        self._count = client.register_script(_COUNT)

    async def admit(self, record: KeyRecord, request_id: str, reserve_tokens: int) -> Admission:
        """Check every limit of the key and, only if all pass, take one request, reserve_tokens and a slot."""
        if record.rpm is None and record.tpm is None and record.max_concurrency is None:
            return ADMITTED
        keys = [redis_keys.limit_key(record.key_id, kind) for kind in ("rpm", "tpm", "concurrency")]
        keys.append(_marker(record, request_id, "admit"))
        limits = [record.rpm or 0, record.tpm or 0, record.max_concurrency or 0]
        reply = await self._admit(keys=keys, args=[*limits, reserve_tokens, request_id, self.LEASE_S])
        if not reply:
            return ADMITTED
        limit = reply[0].decode() if isinstance(reply[0], bytes) else reply[0]
        return Admission(False, limit, float(reply[1]), _refusal_message(record, limit, reserve_tokens))

    async def release(
        self,
        record: KeyRecord,
        request_id: str,
        reserved_tokens: int,
        used_tokens: int,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        cached_tokens: int = 0,
        kv_block_seconds: float = 0.0,
        cached_from: Mapping[str, int] | None = None,
        adapter: str | None = None,
    ) -> None:
        """Free the request's slot, refund the tokens it reserved but did not use (or charge the excess) and
        count it in its tenant's usage: one script, one round trip (a script in a pipeline would cost redis-py
        a SCRIPT EXISTS round trip more). cached_from: of cached_tokens, those a KV tier loaded or a peer's
        pull brought (shared.cache_sources), which split them by source; the pool held the rest. adapter: the
        LoRA adapter it ran under, whose own counters count it again."""
        usage = {
            "requests": 1,
            "prompt_tokens": prompt_tokens,
            "cached_tokens": cached_tokens,
            **{f"cached_tokens_{s}": n for s, n in by_source(cached_tokens, cached_from or {}).items()},
            "computed_prompt_tokens": max(0, prompt_tokens - cached_tokens),
            "completion_tokens": completion_tokens,
        }
        if adapter is not None:
            usage.update({f"{name}{ADAPTER_USAGE}{adapter}": usage[name] for name in ADAPTER_USAGE_COUNTERS})
        await self._give_back(record, request_id, reserved_tokens - used_tokens, kv_block_seconds, usage)

    async def withdraw(self, record: KeyRecord, request_id: str, reserved_tokens: int) -> None:
        """Free the slot and refund the whole reservation of an admitted request that never reached an executor
        (refused after its admission, or its client left): nothing counts in its tenant's usage."""
        await self._give_back(record, request_id, reserved_tokens, 0.0, {})

    async def _give_back(
        self, record: KeyRecord, request_id: str, refund: int, kv_block_seconds: float, usage: dict[str, int]
    ) -> None:
        keys = [redis_keys.limit_key(record.key_id, kind) for kind in ("tpm", "concurrency")]
        keys += [
            redis_keys.tenant_usage_key(record.tenant),
            _marker(record, request_id, "release"),
        ]
        args = [record.tpm or 0, refund, request_id, kv_block_seconds]
        args += [part for pair in usage.items() for part in pair]
        await self._release(keys=keys, args=args)

    async def refresh(self, leases: list[tuple[KeyRecord, str]]) -> None:
        """Extend the concurrency leases of requests still running; released ones stay released."""
        limited = [
            (record, request_id) for record, request_id in leases if record.max_concurrency is not None
        ]
        if not limited:
            return
        keys = [redis_keys.limit_key(record.key_id, "concurrency") for record, _ in limited]
        await self._refresh(keys=keys, args=[self.LEASE_S, *(request_id for _, request_id in limited)])

    async def count_kv_block_seconds(
        self, record: KeyRecord, request_id: str, kv_block_seconds: float
    ) -> None:
        await self._count_once(record, request_id, "HINCRBYFLOAT", "kv_block_seconds", kv_block_seconds)

    async def count_rejected(self, record: KeyRecord, request_id: str) -> None:
        """Count a refused (429) request in its tenant's usage."""
        await self._count_once(record, request_id, "HINCRBY", "rejected", 1)

    async def _count_once(
        self, record: KeyRecord, request_id: str, command: str, counter: str, amount: float
    ) -> None:
        keys = [
            redis_keys.tenant_usage_key(record.tenant),
            _marker(record, request_id, counter),
        ]
        await self._count(keys=keys, args=[command, counter, amount])
