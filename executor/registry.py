"""The executor's published copy of itself in Redis: registration, heartbeat, cached block hashes, load, stats.

Key names live in shared.redis_keys, which the gateway reads too. The block pool stays the truth; Redis is a
copy, so a write that fails is kept and retried with the next one rather than lost.
"""

from __future__ import annotations

import logging
import threading
import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from shared import redis_keys as keys
from shared.executor_stats import ExecutorStats

log = logging.getLogger("kvserve.executor.registry")

# Redis sits in the engine loop: a write to an unreachable Redis must fail in well under a step, not retry
# with backoff for seconds while every stream stalls
REDIS_TIMEOUT_S = 0.5


def connect(url: str) -> redis.Redis:
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=REDIS_TIMEOUT_S,
        socket_timeout=REDIS_TIMEOUT_S,
        retry=Retry(NoBackoff(), 0),
    )


class Registry:
    def __init__(self, client: redis.Redis, executor_id: str, ttl_s: int = keys.HEARTBEAT_TTL_S) -> None:
        self.client = client
        self.executor_id = keys.check_executor_id(executor_id)
        self.ttl_s = ttl_s
        self.keys = keys.executor_keys(executor_id)
        self._pending_added: set[str] = set()
        self._pending_removed: set[str] = set()
        self._pending_stats: dict[str, float] | None = None
        self._failing = False
        self._info: dict[str, str | int | float] = {}
        self._beating: threading.Thread | None = None

    def register(self, info: dict[str, str | int]) -> None:
        """Clear whatever an earlier run under this id left, then announce this one, with zero stats, so a
        scrape sees this executor from the start."""
        self._info = {**info, "started_at": time.time()}
        pipe = self.client.pipeline()
        pipe.delete(*self.keys, keys.inflight_key(self.executor_id))
        self._announce(pipe)
        pipe.hset(keys.stats_key(self.executor_id), mapping=ExecutorStats().to_hash())
        pipe.expire(keys.stats_key(self.executor_id), self.ttl_s)
        pipe.execute()

    def _announce(self, pipe) -> None:
        # rewritten on every heartbeat, so a registration that expired (a stall, a Redis restart) comes back
        pipe.hset(keys.executor_key(self.executor_id), mapping=self._info)
        pipe.expire(keys.executor_key(self.executor_id), self.ttl_s)
        pipe.sadd(keys.EXECUTORS, self.executor_id)

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
        (ExecutorStats.to_hash()), fresh TTLs, and on a heartbeat the registration again. While Redis is failing,
        changes wait for the next heartbeat."""
        for h in added:
            self._pending_removed.discard(h.hex())
            self._pending_added.add(h.hex())
        for h in removed:
            self._pending_added.discard(h.hex())
            self._pending_removed.add(h.hex())
        if stats is not None:
            self._pending_stats = stats  # cumulative: the newest replaces one that has not gone out
        if self._failing and not heartbeat:
            return
        blocks = keys.blocks_key(self.executor_id)
        pipe = self.client.pipeline(transaction=False)
        if self._pending_added:
            pipe.sadd(blocks, *self._pending_added)
        if self._pending_removed:
            pipe.srem(blocks, *self._pending_removed)
        pipe.hset(keys.load_key(self.executor_id), mapping={**load, "updated_at": time.time()})
        if self._pending_stats is not None:
            pipe.hset(keys.stats_key(self.executor_id), mapping=self._pending_stats)
        if heartbeat:
            self._announce(pipe)
        self._refresh_ttls(pipe)
        try:
            pipe.execute()
        except redis.RedisError as error:
            if not self._failing:  # one line per outage, not one per step
                log.warning("publishing to Redis failed, will retry: %s", error)
            self._failing = True
            return
        if self._failing:
            log.info("publishing to Redis works again")
        self._failing = False
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
            self._announce(pipe)
            self._refresh_ttls(pipe)
            try:
                pipe.execute()
            except redis.RedisError as error:
                if not failing:
                    log.warning("heartbeat to Redis failed, will retry: %s", error)
                failing = True
                continue
            failing = False

    def deregister(self) -> None:
        if self._beating is not None:
            self._stop_beating.set()
            self._beating.join()
            self._beating = None
        pipe = self.client.pipeline()
        pipe.delete(*self.keys, keys.inflight_key(self.executor_id))
        pipe.srem(keys.EXECUTORS, self.executor_id)
        pipe.execute()
