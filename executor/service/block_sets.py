"""The executor's published block sets in Redis, one per place a block can be (the KV pool, the host tier, the disk
tier: shared.redis_keys): the changes not yet written, and whether Redis lost the set, so it is written whole.

The index writer (executor/service/index_writer.py) queues every set's writes into its one pipeline per publish.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from shared import redis_keys as keys

POOL = "pool"  # the name of the pool's set among the tiers' (shared.redis_keys.TIERS)


class BlockSet:
    """One set of hex block hashes and its marker. Its changes are the engine loop's to note and send; lost is
    set by whichever thread's heartbeat finds the marker gone (the heartbeat has a thread of its own)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.added: set[str] = set()
        self.removed: set[str] = set()
        # Redis lost it: the next publish replaces it with what the executor holds
        self.lost = threading.Event()

    def note(self, added: Iterable[bytes], removed: Iterable[bytes]) -> None:
        """Net the changes with those not written yet: a hash cached then evicted before a publish is neither."""
        for h in added:
            self.removed.discard(h.hex())
            self.added.add(h.hex())
        for h in removed:
            self.added.discard(h.hex())
            self.removed.add(h.hex())

    @property
    def pending(self) -> bool:
        return bool(self.added or self.removed)

    def queue(self, pipe, whole: Iterable[bytes] | None = None) -> None:
        """Queue the changes; given whole (every hash held now), replace the set by it instead. The pending changes
        stay until sent() (a failed write keeps them for the next)."""
        if whole is not None:
            self.added = {h.hex() for h in whole}
            self.removed.clear()
            pipe.delete(self.key)
            pipe.sadd(self.key, keys.BLOCKS_MARKER, *self.added)
        elif self.added:
            pipe.sadd(self.key, *self.added)
        if self.removed:
            pipe.srem(self.key, *self.removed)

    def queue_marker(self, pipe) -> int:
        """Queue the marker, written on every heartbeat; the index of its reply (1: it was missing)."""
        pipe.sadd(self.key, keys.BLOCKS_MARKER)
        return len(pipe) - 1

    def sent(self) -> None:
        self.added.clear()
        self.removed.clear()


def block_sets(executor_id: str) -> dict[str, BlockSet]:
    """The pool's set and each tier's, by name (POOL, then shared.redis_keys.TIERS)."""
    sets = {POOL: BlockSet(keys.blocks_key(executor_id))}
    sets.update((tier, BlockSet(keys.tier_key(executor_id, tier))) for tier in keys.TIERS)
    return sets
