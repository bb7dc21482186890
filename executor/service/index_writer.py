"""The writing half of the executor index in Redis (gateway/routing/index_reader.py reads it): the executor's published
copy of itself: registration, heartbeat, cached block hashes (the pool's and each KV tier's), load, stats.

Key names live in shared.redis_keys, which the gateway reads too. The block pool and the tiers' indexes stay the
truth; Redis is a copy, so a write that fails is kept and retried with the next one rather than lost, and a copy
Redis lost (a restart, a failover, an eviction) is written again whole: each blocks set carries a marker member,
and a heartbeat that finds it missing has the next publish replace the set with what the pool (or tier) holds.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from executor.service.block_sets import POOL, block_sets
from shared import redis_keys as keys
from shared.executor_stats import ExecutorStats

log = logging.getLogger("kvserve.executor.index_writer")

# Redis sits in the engine loop: a write to an unreachable Redis must fail in well under a step, not retry
# with backoff for seconds while every stream stalls
REDIS_TIMEOUT_S = 0.5


def connect(url: str) -> redis.Redis:
    """A connection error is retried once at once, on a fresh connection: after a Redis restart the pooled
    connections are stale, and the first write on each failed. A timeout is not retried (the step would
    wait twice)."""
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=REDIS_TIMEOUT_S,
        socket_timeout=REDIS_TIMEOUT_S,
        retry=Retry(NoBackoff(), 1, (redis.ConnectionError,)),
    )


# KEYS[1]: the set of executor ids. ARGV: this executor's id, the key prefix, the load suffix. 1 when another
# live executor could start a request now (its queue not full, nothing waiting), else 0.
_PEER_HAS_ROOM = """
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if id ~= ARGV[1] and redis.call('EXISTS', ARGV[2] .. id) == 1 then
    local load = redis.call('HMGET', ARGV[2] .. id .. ARGV[3], 'queue_full', 'waiting')
    if load[1] ~= '1' and (not load[2] or tonumber(load[2]) == 0) then return 1 end
  end
end
return 0
"""
_PREFIX = keys.executor_key("")
_LOAD_SUFFIX = keys.load_key("").removeprefix(_PREFIX)


class IndexWriter:
    """cached_hashes gives the block pool's cached hashes, tier_hashes every hash each KV tier holds by tier name
    (shared.redis_keys.TIERS; a tier that is off may be absent); publish() calls them, from the engine loop's
    thread, the only one that changes the pool and the tiers' indexes, so the copy it writes matches the changes
    drained before it."""

    def __init__(
        self,
        client: redis.Redis,
        executor_id: str,
        ttl_s: int = keys.HEARTBEAT_TTL_S,
        cached_hashes: Callable[[], Iterable[bytes]] = tuple,
        tier_hashes: Callable[[], Mapping[str, Iterable[bytes]]] = dict,
        watch_adapters: bool = False,
    ) -> None:
        self.client = client
        self.executor_id = keys.check_executor_id(executor_id)
        self.ttl_s = ttl_s
        self.keys = keys.executor_keys(executor_id)
        self.sets = block_sets(executor_id)
        self._pending_stats: dict[str, float] | None = None
        self._last_stats: dict[str, float] | None = None  # what a republish writes again
        # the load as Redis holds it: a step that changes nothing a reader sees (most decode steps at one stream)
        # costs no round trip, whose client and server time would stall the engine's threads
        self._published_load: dict[str, float] | None = None
        self._cached_hashes = cached_hashes
        self._tier_hashes = tier_hashes
        # whether another live executor could start a request at once, as of the last heartbeat: only then is
        # a request that waits here too long handed back (alone, it would only lose its place in the queue)
        self.peer_has_room = False
        self._peer_has_room = client.register_script(_PEER_HAS_ROOM)
        self._failing = False
        self._info: dict[str, str | int | float] = {}
        self._beating: threading.Thread | None = None
        # the run-time LoRA registry (shared.redis_keys.LORA_ADAPTERS) as of the last heartbeat, name -> path;
        # read only by an executor serving adapters, None until first read
        self.watch_adapters = watch_adapters
        self.adapter_registry: dict[str, str] | None = None

    def register(self, info: dict[str, str | int]) -> None:
        """Clear whatever an earlier run under this id left, then announce this one, with zero stats, so a
        scrape sees this executor from the start."""
        self._info = {**info, "started_at": time.time()}
        self._last_stats = ExecutorStats().to_hash()
        pipe = self.client.pipeline()
        pipe.delete(*self.keys, keys.inflight_key(self.executor_id))
        self._announce(pipe)
        pipe.hset(keys.stats_key(self.executor_id), mapping=self._last_stats)
        pipe.expire(keys.stats_key(self.executor_id), self.ttl_s)
        pipe.execute()
        # a tier may hold blocks from the start (a disk tier finds its files there): the first publish writes each
        # tier's set whole
        for tier in keys.TIERS:
            self.sets[tier].lost.set()

    def update_info(self, fields: dict[str, str]) -> None:
        """Change fields of the registration: written with the next heartbeat."""
        self._info = {**self._info, **fields}

    def _announce(self, pipe) -> dict[str, int]:
        """Queue the registration, rewritten on every heartbeat so one that expired (a stall, a Redis restart)
        comes back, and each blocks set's marker; returns the index of each marker's reply, by set name."""
        pipe.hset(keys.executor_key(self.executor_id), mapping=self._info)
        pipe.expire(keys.executor_key(self.executor_id), self.ttl_s)
        pipe.sadd(keys.EXECUTORS, self.executor_id)
        return {name: block_set.queue_marker(pipe) for name, block_set in self.sets.items()}

    def _check_markers(self, replies: list, marker_replies: dict[str, int]) -> None:
        for name, reply in marker_replies.items():
            lost = self.sets[name].lost
            if replies[reply] and not lost.is_set():
                log.warning(
                    "Redis lost this executor's %s blocks set (restart, failover or eviction): republishing",
                    name,
                )
                lost.set()

    def _refresh_ttls(self, pipe) -> None:
        """Every key of this executor lives exactly as long as its heartbeat."""
        for key in self.keys:
            pipe.expire(key, self.ttl_s)

    def publish(
        self,
        added: list[bytes],
        removed: list[bytes],
        load: dict[str, float],
        heartbeat: bool = False,
        stats: dict[str, float] | None = None,
        tiers: Mapping[str, tuple[list[bytes], list[bytes]]] | None = None,
    ) -> None:
        """One round trip: block hashes the pool cached and evicted since the last call, and each tier's (tiers:
        tier name -> (added, removed)), the load, the stats when given (ExecutorStats.to_hash()), fresh TTLs, and
        on a heartbeat the registration again; none at all when nothing is new (no blocks, no stats, no
        heartbeat, the load as last written). While Redis is failing, changes wait for the next heartbeat."""
        self.sets[POOL].note(added, removed)
        for tier, (tier_added, tier_removed) in (tiers or {}).items():
            self.sets[tier].note(tier_added, tier_removed)
        if stats is not None:
            self._pending_stats = self._last_stats = stats  # cumulative: the newest replaces one not gone out
        if self._failing and not heartbeat:
            return
        lost = [name for name, block_set in self.sets.items() if block_set.lost.is_set()]
        pending = any(block_set.pending for block_set in self.sets.values())
        unchanged = not (pending or self._pending_stats is not None)
        if unchanged and not (heartbeat or lost) and load == self._published_load:
            return
        # a republish replaces the set in one transaction: no reader, and no heartbeat checking the marker,
        # sees it half written
        pipe = self.client.pipeline(transaction=bool(lost))
        held_by_tier = self._tier_hashes() if any(name != POOL for name in lost) else {}
        for name, block_set in self.sets.items():
            if name in lost:
                block_set.lost.clear()  # set again by a heartbeat that finds the marker gone after this
                block_set.queue(pipe, self._cached_hashes() if name == POOL else held_by_tier.get(name, ()))
            else:
                block_set.queue(pipe)
        if lost and self._pending_stats is None:
            self._pending_stats = self._last_stats
        pipe.hset(keys.load_key(self.executor_id), mapping={**load, "updated_at": time.time()})
        if self._pending_stats is not None:
            pipe.hset(keys.stats_key(self.executor_id), mapping=self._pending_stats)
        marker_replies = self._announce(pipe) if heartbeat else {}
        self._refresh_ttls(pipe)
        try:
            replies = pipe.execute()
        except redis.RedisError as error:
            if not self._failing:  # one line per outage, not one per step
                log.warning("publishing to Redis failed, will retry: %s", error)
            self._failing = True
            for name in lost:
                self.sets[name].lost.set()
            return
        if self._failing:
            log.info("publishing to Redis works again")
        for name in lost:  # the warning that it was lost went out when a heartbeat found it so
            log.debug(
                "wrote this executor's %s blocks set whole: %d blocks", name, len(self.sets[name].added)
            )
        self._failing = False
        self._published_load = dict(load)
        self._check_markers(replies, marker_replies)
        for block_set in self.sets.values():
            block_set.sent()
        self._pending_stats = None

    def start_heartbeat(self) -> None:
        """Keep the registration alive from a thread of its own: a long engine step (a big prefill on a busy
        CPU) must not look to the gateways like a dead executor."""
        self._stop_beating = threading.Event()
        self._beating = threading.Thread(target=self._beat, name="kvserve-heartbeat", daemon=True)
        self._beating.start()

    def _beat(self) -> None:
        failing = False
        while not self._stop_beating.wait(keys.HEARTBEAT_INTERVAL_S):
            pipe = self.client.pipeline(transaction=False)
            marker_replies = self._announce(pipe)
            self._refresh_ttls(pipe)
            if self.watch_adapters:
                pipe.hgetall(keys.LORA_ADAPTERS)
            try:
                replies = pipe.execute()
                self._check_markers(replies, marker_replies)
                if self.watch_adapters:
                    self.adapter_registry = adapter_paths(replies[-1])
                self.check_peers()
            except redis.RedisError as error:
                self.peer_has_room = False
                if not failing:
                    log.warning("heartbeat to Redis failed, will retry: %s", error)
                failing = True
                continue
            failing = False

    def check_peers(self) -> bool:
        """Read whether another live executor has room now (peer_has_room); the heartbeat does it each beat."""
        args = [self.executor_id, _PREFIX, _LOAD_SUFFIX]
        self.peer_has_room = bool(self._peer_has_room(keys=[keys.EXECUTORS], args=args))
        return self.peer_has_room

    def deregister(self) -> None:
        if self._beating is not None:
            self._stop_beating.set()
            self._beating.join()
            self._beating = None
        pipe = self.client.pipeline()
        pipe.delete(*self.keys, keys.inflight_key(self.executor_id))
        pipe.srem(keys.EXECUTORS, self.executor_id)
        pipe.execute()


def adapter_paths(registry: Mapping[bytes, bytes]) -> dict[str, str]:
    """The run-time LoRA registry's entries (name -> JSON {"path": ...}) as name -> path; one that is not such an
    entry is skipped with a warning (the gateway writes none: a hand edit)."""
    paths = {}
    for name, entry in registry.items():
        try:
            path = json.loads(entry)["path"]
            if not isinstance(path, str):
                raise TypeError(f"path is {type(path).__name__}")
            paths[name.decode()] = path
        except (ValueError, KeyError, TypeError) as error:
            log.warning("skipping LoRA registry entry %r: %r", name, error)
    return paths
