"""The reading half of the executor index in Redis (executor/service/index_writer.py writes it): what the gateway
knows of the executors, read fresh for each request (the gateway keeps none).

One Lua script reads everything a routing decision needs in a single round trip: which registered executors
are still alive, their registration, where each holds the prompt's leading blocks (its KV pool, its host tier, its
disk tier), and each one's load.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff

from gateway.routing.cost import Candidate
from shared import redis_keys
from shared.executor_stats import ExecutorStats

log = logging.getLogger("kvserve.gateway.index_reader")

# Every Redis command of a request is short (one round trip, well under a millisecond on a healthy Redis), so a
# burst of requests larger than the pool waits a moment for a free connection instead of failing (redis-py's
# default pool refuses past 100: a burst of 150 got 50 x 503). The wait is bounded: a Redis that stopped
# answering holds every connection until REDIS_TIMEOUT_S, and the requests behind them get 503, not a hang.
REDIS_MAX_CONNECTIONS = 128
REDIS_POOL_WAIT_S = 5.0
REDIS_CONNECT_TIMEOUT_S = 2.0
REDIS_TIMEOUT_S = 5.0


def connect(redis_url: str) -> aioredis.Redis:
    """The gateway's Redis client, shared by the directory and tenancy. A command that meets a connection
    error is retried once on a fresh connection: after a Redis restart or failover every pooled connection is
    stale, and each would otherwise fail one request on its first use, seconds after Redis is back.
    Timeouts are not retried: the command may have run (a rate-limit admission, an in-flight count), and a
    Redis that does not answer should cost a request one timeout, not two."""
    pool = aioredis.BlockingConnectionPool.from_url(
        redis_url,
        max_connections=REDIS_MAX_CONNECTIONS,
        timeout=REDIS_POOL_WAIT_S,
        socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S,
        socket_timeout=REDIS_TIMEOUT_S,
        retry=Retry(ExponentialWithJitterBackoff(cap=0.1, base=0.01), 1, (redis.ConnectionError,)),
    )
    return aioredis.Redis.from_pool(pool)


# A retried command may have run already (the connection broke after Redis ran it, before its reply came): a script
# that writes starts with this, so it applies once. Its last key is the write's marker, unique to the request or
# the call; a retry sends the same key, finds it, and writes nothing.
APPLY_ONCE = f"""
if not redis.call('SET', KEYS[#KEYS], '1', 'NX', 'EX', {redis_keys.APPLIED_TTL_S}) then return 0 end
"""


@dataclass(slots=True)
class ExecutorInfo:
    executor_id: str
    address: str
    model: str
    block_size: int
    max_model_len: int
    # it refuses a tenant's request while that tenant has this many waiting (0: not published), and anyone's while
    # waiting_tenants_share times as many wait in all (1: one bound for all tenants, an older or unfair executor)
    max_waiting_seqs: int = 0
    waiting_tenants_share: int = 1
    # where its KV transfer server answers pulls, and the hex digest of what makes its KV blocks interchangeable
    # with another's (model, dtype, block shape, quantization): "" when it publishes none (no pulls to or from it)
    kv_transfer_address: str = ""
    kv_fingerprint: str = ""
    # LoRA (docs/lora.md): whether it serves adapters (--enable-lora), those it serves, name -> digest of their
    # files, and those of the run-time registry it refused, name -> (the path it tried, why)
    lora: bool = False
    lora_adapters: dict[str, str] = field(default_factory=dict)
    lora_refused: dict[str, tuple[str, str]] = field(default_factory=dict)


# KEYS[1]: the set of executor ids. ARGV: key prefix; blocks (pool), host, disk, load and inflight suffixes; then
# the prompt's hex hashes. Returns, per live executor: {id, registration (flat HGETALL), the best tier code of each
# leading block (1 pool, 2 host, 3 disk; cost.POOL, HOST, DISK) up to the first held nowhere, load (flat
# HGETALL), in-flight count (or nil)}.
_ROUTING_VIEW = """
local prefix, load, inflight = ARGV[1], ARGV[5], ARGV[6]
local sets = {ARGV[2], ARGV[3], ARGV[4]}  -- best first: a tier's code is its place here
local RUN = 4096
local hashes = {}
for i = 7, #ARGV do hashes[#hashes + 1] = ARGV[i] end
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local key = prefix .. id
  local info = redis.call('HGETALL', key)
  if #info > 0 then
    -- in runs: Lua's unpack takes ~8,000 values at most; only the leading run counts, so stop at a miss
    local held = {}
    for first = 1, #hashes, RUN do
      local last = math.min(first + RUN - 1, #hashes)
      local best = {}
      local missing = last - first + 1
      -- the next tier is asked only while some block of the run is in none of the better ones
      for code, suffix in ipairs(sets) do
        if missing == 0 then break end
        local flags = redis.call('SMISMEMBER', key .. suffix, unpack(hashes, first, last))
        for i, flag in ipairs(flags) do
          if flag == 1 and not best[i] then
            best[i] = code
            missing = missing - 1
          end
        end
      end
      local missed = false
      for i = 1, last - first + 1 do
        if not best[i] then missed = true break end
        held[#held + 1] = best[i]
      end
      if missed then break end
    end
    out[#out + 1] = {id, info, held, redis.call('HGETALL', key .. load), redis.call('GET', key .. inflight)}
  end
end
return out
"""
# KEYS: the in-flight count, the call's marker. ARGV: the change, the count's TTL.
_ADD_INFLIGHT = (
    APPLY_ONCE
    + """
redis.call('INCRBY', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 0
"""
)
# KEYS[1]: the set of executor ids. ARGV[1]: key prefix, ARGV[2]: stats suffix. Per live executor: {id, stats}.
_STATS = """
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local key = ARGV[1] .. id
  if redis.call('EXISTS', key) == 1 then
    out[#out + 1] = {id, redis.call('HGETALL', key .. ARGV[2])}
  end
end
return out
"""
_PREFIX = redis_keys.executor_key("")
_BLOCKS_SUFFIX = redis_keys.blocks_key("").removeprefix(_PREFIX)
# in the order of their codes, after the pool's: cost.HOST, cost.DISK
_TIER_SUFFIXES = [redis_keys.tier_key("", tier).removeprefix(_PREFIX) for tier in ("host", "disk")]
_LOAD_SUFFIX = redis_keys.load_key("").removeprefix(_PREFIX)
_INFLIGHT_SUFFIX = redis_keys.inflight_key("").removeprefix(_PREFIX)
_STATS_SUFFIX = redis_keys.stats_key("").removeprefix(_PREFIX)


def _as_dict(flat: list[bytes]) -> dict[str, str]:
    return {flat[i].decode(): flat[i + 1].decode() for i in range(0, len(flat), 2)}


def _json_map(executor_id: str, name: str, text: str | None, is_value, shape: str) -> dict:
    """A registration's JSON object of names to values that is_value accepts (absent: empty); one that is not
    is logged and read as empty, so a broken registration serves no adapter rather than failing every request."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict) or not all(is_value(v) for v in value.values()):
        log.warning(
            "executor %s publishes %s that is not a JSON object of %s: %.200r", executor_id, name, shape, text
        )
        return {}
    return value


def _refusal(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(value.get(k), str) for k in ("path", "error"))


def _refusals(executor_id: str, text: str | None) -> dict[str, tuple[str, str]]:
    """lora_refused: name -> (the path tried, why)."""
    refused = _json_map(executor_id, "lora_refused", text, _refusal, '{"path", "error"} objects')
    return {name: (r["path"], r["error"]) for name, r in refused.items()}


def _names(text: str | None) -> frozenset[str]:
    return frozenset(name for name in (text or "").split(",") if name)


class IndexReader:
    def __init__(self, redis_url: str) -> None:
        self.redis = connect(redis_url)
        self._routing_view = self.redis.register_script(_ROUTING_VIEW)
        self._stats = self.redis.register_script(_STATS)
        self._add_inflight = self.redis.register_script(_ADD_INFLIGHT)

    async def close(self) -> None:
        await self.redis.aclose()

    async def routing_view(self, block_hashes: Sequence[bytes] = ()) -> list[tuple[ExecutorInfo, Candidate]]:
        """Live executors (registered, heartbeat not expired), sorted by id, each with where it holds the leading
        run of block_hashes and its load, in one round trip."""
        suffixes = [_BLOCKS_SUFFIX, *_TIER_SUFFIXES, _LOAD_SUFFIX, _INFLIGHT_SUFFIX]
        args = [_PREFIX, *suffixes, *(h.hex() for h in block_hashes)]
        rows = await self._routing_view(keys=[redis_keys.EXECUTORS], args=args)
        view = []
        for raw_id, raw_info, held, raw_load, inflight in rows:
            executor_id, info, load = raw_id.decode(), _as_dict(raw_info), _as_dict(raw_load)
            view.append(
                (
                    ExecutorInfo(
                        executor_id,
                        info["address"],
                        info.get("model", ""),
                        int(info["block_size"]),
                        int(info["max_model_len"]),
                        int(info.get("max_waiting_seqs", 0)),
                        int(info.get("waiting_tenants_share", 1)),
                        info.get("kv_transfer_address", ""),
                        info.get("kv_fingerprint", ""),
                        "lora_adapters" in info,
                        _json_map(
                            executor_id,
                            "lora_adapters",
                            info.get("lora_adapters"),
                            lambda v: isinstance(v, str),
                            "strings",
                        ),
                        _refusals(executor_id, info.get("lora_refused")),
                    ),
                    Candidate(
                        executor_id,
                        info["address"],
                        held=tuple(held),
                        running=int(load.get("running", 0)),
                        waiting=int(load.get("waiting", 0)),
                        compiling=int(load.get("compiling", 0)),
                        kv_usage=float(load.get("kv_usage", 0.0)),
                        kv_filled=float(load.get("kv_filled", 0.0)),
                        prefill_tokens=int(load.get("prefill_tokens", 0)),
                        inflight_tokens=max(0, int(inflight or 0)),
                        queue_full=load.get("queue_full") == "1",
                        lora_running=_names(load.get("lora_running")),
                        lora_held=_names(load.get("lora_held")),
                        max_loras=int(info.get("max_loras", 0)),
                    ),
                )
            )
        return sorted(view, key=lambda pair: pair[0].executor_id)

    async def executor_stats(self) -> dict[str, ExecutorStats]:
        """Every live executor's published stats, in one round trip."""
        rows = await self._stats(keys=[redis_keys.EXECUTORS], args=[_PREFIX, _STATS_SUFFIX])
        return {raw_id.decode(): ExecutorStats.from_hash(_as_dict(flat)) for raw_id, flat in rows}

    async def live_executors(self) -> list[ExecutorInfo]:
        return [info for info, _ in await self.routing_view()]

    async def is_alive(self, executor_id: str) -> bool:
        """Whether the executor's registration is in Redis. A Redis that cannot be reached cannot tell that it
        died: its request goes on over ZeroMQ meanwhile."""
        try:
            return bool(await self.redis.exists(redis_keys.executor_key(executor_id)))
        except redis.RedisError as error:
            log.warning(
                "cannot ask Redis whether executor %s lives, assuming it does: %s", executor_id, error
            )
            return True

    async def add_inflight(self, executor_id: str, delta: int) -> None:
        """Change the executor's in-flight count by delta, once, even if the command is retried."""
        key = redis_keys.inflight_key(executor_id)
        marker = redis_keys.applied_key(key, uuid.uuid4().hex)
        await self._add_inflight(keys=[key, marker], args=[delta, redis_keys.INFLIGHT_TTL_S])

    async def next_round_robin(self) -> int:
        return int(await self.redis.incr(redis_keys.ROUND_ROBIN))
