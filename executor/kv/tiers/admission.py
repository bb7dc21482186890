"""Which blocks the pool caches go down to the KV tiers: every one (recency, the default), or only those seen
twice (reuse), as vLLM's CPU offloading and CDN caches gate admission.

recency: each block the pool caches is offered at once; the tiers' own eviction (shares, scan resistance) then
decides what stays. A conversation's history is offered the first time it is computed, so its next turn finds it
even when the pool has evicted it meanwhile.

reuse: a block is offered on its second appearance: the prefix cache served it (a hit), or it was computed again
after leaving the pool. A bounded list of hashes seen once remembers the first appearances. One-off prompts
(a scan of distinct documents) then never take tier slots, but a block that leaves the pool before it is reused is
computed twice before the tiers keep it: what a conversation whose history outgrows the pool pays.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from executor.kv.block_pool import Block

ADMISSIONS = ("recency", "reuse")


class ReuseAdmission:
    def __init__(self, num_remembered: int) -> None:
        if num_remembered < 1:
            raise ValueError(f"reuse admission must remember at least one hash, got {num_remembered}")
        self.num_remembered = num_remembered
        self._seen: OrderedDict[bytes, None] = OrderedDict()  # first appearances, oldest first
        self._hits: list[bytes] = []  # blocks the prefix cache served since the last admit()

    def prefix_hit(self, blocks: Iterable[Block]) -> None:
        """The prefix cache served these blocks (KVCacheManager.allocate): a second use, admitted next step."""
        self._hits += [b.block_hash for b in blocks if b.block_hash is not None]

    def admit(self, cached: list[bytes]) -> list[bytes]:
        """Of a step's newly cached hashes and the blocks hit since the last call, those to offer to the tiers."""
        admitted, self._hits = self._hits, []
        for block_hash in cached:
            if block_hash in self._seen:
                del self._seen[block_hash]
                admitted.append(block_hash)
                continue
            self._seen[block_hash] = None
            if len(self._seen) > self.num_remembered:
                self._seen.popitem(last=False)
        return admitted
