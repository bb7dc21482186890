"""The writing half of the executor index in Redis (gateway/routing/index_reader.py reads it): the executor's published
copy of itself: registration, heartbeat, cached block hashes, load, stats.

Key names live in shared.redis_keys, which the gateway reads too. The block pool stays the truth; Redis is a
copy, so a write that fails is kept and retried with the next one rather than lost, and a copy Redis lost (a
restart, a failover, an eviction) is written again whole: the blocks set carries a marker member, and a
heartbeat that finds it missing has the next publish replace the set with the pool's cached hashes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

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
    """cached_hashes gives the block pool's cached hashes; publish() calls it, from the engine loop's thread,
    the only one that changes the pool, so the copy it writes matches the changes drained before it."""

    def __init__(
        self,
        client: redis.Redis,
        executor_id: str,
        ttl_s: int = keys.HEARTBEAT_TTL_S,
        cached_hashes: Callable[[], Iterable[bytes]] = tuple,
    ) -> None:
        self.client = client
        self.executor_id = keys.check_executor_id(executor_id)
        self.ttl_s = ttl_s
        self.keys = keys.executor_keys(executor_id)
        self._pending_added: set[str] = set()
        self._pending_removed: set[str] = set()
        self._pending_stats: dict[str, float] | None = None
        self._last_stats: dict[str, float] | None = None  # what a republish writes again
        # the load as Redis holds it: a step that changes nothing a reader sees (most decode steps at one stream)
        # costs no round trip, whose client and server time would stall the engine's threads
        self._published_load: dict[str, float] | None = None
        self._cached_hashes = cached_hashes
        self._lost = threading.Event()  # Redis lost the blocks set: the next publish writes it whole
        # whether another live executor could start a request at once, as of the last heartbeat: only then is
        # a request that waits here too long handed back (alone, it would only lose its place in the queue)
        self.peer_has_room = False
        self._peer_has_room = client.register_script(_PEER_HAS_ROOM)
        self._failing = False
        self._info: dict[str, str | int | float] = {}
        self._beating: threading.Thread | None = None

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

    def _announce(self, pipe) -> int:
        """Queue the registration, rewritten on every heartbeat so one that expired (a stall, a Redis restart)
        comes back, and the blocks set's marker; returns the index of the marker's reply (1: it was missing)."""
        pipe.hset(keys.executor_key(self.executor_id), mapping=self._info)
        pipe.expire(keys.executor_key(self.executor_id), self.ttl_s)
        pipe.sadd(keys.EXECUTORS, self.executor_id)
        pipe.sadd(keys.blocks_key(self.executor_id), keys.BLOCKS_MARKER)
        return len(pipe) - 1

    def _check_marker(self, replies: list, marker_reply: int | None) -> None:
        if marker_reply is not None and replies[marker_reply] and not self._lost.is_set():
            log.warning(
                "Redis lost this executor's cached blocks (restart, failover or eviction): republishing"
            )
            self._lost.set()

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
    ) -> None:
        """One round trip: block hashes cached and evicted since the last call, the load, the stats when given
        (ExecutorStats.to_hash()), fresh TTLs, and on a heartbeat the registration again; none at all when nothing
        is new (no blocks, no stats, no heartbeat, the load as last written). While Redis is failing, changes
        wait for the next heartbeat."""
        for h in added:
            self._pending_removed.discard(h.hex())
            self._pending_added.add(h.hex())
        for h in removed:
            self._pending_added.discard(h.hex())
            self._pending_removed.add(h.hex())
        if stats is not None:
            self._pending_stats = self._last_stats = stats  # cumulative: the newest replaces one not gone out
        if self._failing and not heartbeat:
            return
        blocks = keys.blocks_key(self.executor_id)
        republish = self._lost.is_set()
        unchanged = not (self._pending_added or self._pending_removed or self._pending_stats is not None)
        if unchanged and not (heartbeat or republish) and load == self._published_load:
            return
        # a republish replaces the set in one transaction: no reader, and no heartbeat checking the marker,
        # sees it half written
        pipe = self.client.pipeline(transaction=republish)
        if republish:
            self._lost.clear()  # set again by a heartbeat that finds the marker gone after this
            self._pending_added = {h.hex() for h in self._cached_hashes()}
            self._pending_removed.clear()
            if self._pending_stats is None:
                self._pending_stats = self._last_stats
            pipe.delete(blocks)
            pipe.sadd(blocks, keys.BLOCKS_MARKER, *self._pending_added)
        elif self._pending_added:
            pipe.sadd(blocks, *self._pending_added)
        if self._pending_removed:
            pipe.srem(blocks, *self._pending_removed)
        pipe.hset(keys.load_key(self.executor_id), mapping={**load, "updated_at": time.time()})
        if self._pending_stats is not None:
            pipe.hset(keys.stats_key(self.executor_id), mapping=self._pending_stats)
        marker_reply = self._announce(pipe) if heartbeat else None
        self._refresh_ttls(pipe)
        try:
            replies = pipe.execute()
        except redis.RedisError as error:
            if not self._failing:  # one line per outage, not one per step
                log.warning("publishing to Redis failed, will retry: %s", error)
            self._failing = True
            if republish:
                self._lost.set()
            return
        if self._failing:
            log.info("publishing to Redis works again")
        if republish:
            log.info("republished %d cached blocks to Redis", len(self._pending_added))
        self._failing = False
        self._published_load = dict(load)
        self._check_marker(replies, marker_reply)
        self._pending_added.clear()
        self._pending_removed.clear()
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
            marker_reply = self._announce(pipe)
            self._refresh_ttls(pipe)
            try:
                self._check_marker(pipe.execute(), marker_reply)
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
