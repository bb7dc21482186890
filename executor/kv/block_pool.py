"""The pool of physical KV blocks: ref counts, and the prefix cache of freed-but-still-valid blocks.

KV shares (on by default): which cached block a new one evicts depends on whose it is. Each block belongs to the
tenant whose request took it; a tenant's share of the pool is num_blocks x its weight / the weights of every
tenant owning blocks (and the one asking). Free blocks with nothing cached go first, then cached blocks of
tenants over their share (the most over first), then the asking tenant's own; another tenant's blocks within
its share go only where the caller lets them (cache_manager.py: so running requests never starve). In
each tenant's cache, blocks never reused go before blocks reused at least once (a scan of one-off prompts passes
through without flushing a hot prefix), least recently freed first within each. Off: one LRU of all free
blocks.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from shared.tenant import ANONYMOUS_TENANT, Tenant


@dataclass(eq=False, slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    # set once the block is full and its KV computed; kept after free so the block stays reusable
    block_hash: bytes | None = None
    # the tenant whose request last took it from the free blocks, and how often the prefix cache served it since
    owner: Tenant = ANONYMOUS_TENANT
    num_hits: int = 0
    # how often it was handed out: a reader on another thread (a peer's pull) copies a cached block without a
    # reference and keeps the copy only if this did not change meanwhile (a block is written only once handed out)
    generation: int = 0


class BlockPool:
    """Owns every block. Free blocks wait in eviction order; a cached one keeps its hash until it is reused."""

    def __init__(
        self, num_blocks: int, enable_caching: bool = True, record_events: bool = False, shares: bool = True
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.shares = shares
        self.blocks = [Block(i) for i in range(num_blocks)]
        # eviction takes from the front, free() appends at the back. With shares: free blocks with no hash, never
        # used ones first; cached ones wait in _idle, per owner, (never reused, reused). Without: every free block.
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._idle: dict[Tenant, tuple[OrderedDict[int, Block], OrderedDict[int, Block]]] = {}
        self._num_free = num_blocks
        # per tenant owning any: blocks referenced, and cached blocks nobody references; its latest weight
        self._num_held: dict[Tenant, int] = {}
        self._num_idle: dict[Tenant, int] = {}
        self._weights: dict[Tenant, float] = {}
        self._cached: dict[bytes, Block] = {}
        # hash -> whether it was cached when first touched since the last drain (the engine drains it every
        # step); None: not recording, so nothing accumulates
        self._events: dict[bytes, bool] | None = {} if record_events else None

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._num_free

    @property
    def num_empty_blocks(self) -> int:
        """Free blocks holding nothing cached: what allocations take before they evict."""
        return self._num_free - sum(self._num_idle.values())

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose KV the prefix cache holds, referenced or not."""
        return len(self._cached)

    def num_held(self, tenant: Tenant) -> int:
        """Blocks the tenant's requests hold now."""
        return self._num_held.get(tenant, 0)

    def tenant_blocks(self) -> dict[Tenant, tuple[int, int]]:
        """Per tenant owning blocks: (held by its requests, cached and free)."""
        tenants = self._num_held.keys() | self._num_idle.keys()
        return {t: (self._num_held.get(t, 0), self._num_idle.get(t, 0)) for t in tenants}

    def lookup(self, block_hash: bytes) -> Block | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on cached blocks a new request reuses: a hit, which moves them to the reused."""
        self.share(blocks)
        for block in blocks:
            block.num_hits += 1

    def share(self, blocks: list[Block]) -> None:
        """Take one more reference on each block (a hit, or forked choices sharing their prompt's blocks)."""
        for block in blocks:
            if block.ref_count == 0:
                self._dequeue(block)
                self._num_free -= 1
                self._add(self._num_held, block.owner, 1)
                self._add(self._num_idle, block.owner, -1)
            block.ref_count += 1

    def num_allocatable(self, tenant: Tenant = ANONYMOUS_TENANT, evict_others: bool = True) -> int:
        """How many blocks allocate() with these arguments can hand out now."""
        if evict_others or not self.shares:
            return self._num_free
        shares = self._shares(tenant)
        n = len(self._free) + self._num_idle.get(tenant, 0)
        for other, idle in self._num_idle.items():
            if other != tenant:  # evicted while over: usage - k > share, for k = 0, 1, ...
                n += min(idle, max(0, self._usage(other) - math.floor(shares[other])))
        return n

    def allocate(self, n: int, tenant: Tenant = ANONYMOUS_TENANT, evict_others: bool = True) -> list[Block]:
        """n blocks for a request of tenant's (at the weight it carries), evicting cached blocks as the shares say;
        another tenant's blocks within its share only if evict_others."""
        room = self.num_allocatable(tenant, evict_others)
        if n > room:
            raise RuntimeError(f"asked for {n} KV blocks, {room} to be had")
        # the shares, fixed for the call (num_allocatable's), are needed only once no free block is left: until
        # then only the asking tenant's own count grows, and it is in them already
        shares: dict[Tenant, float] | None = None
        out = []
        for _ in range(n):
            if not self._free and shares is None:
                shares = self._shares(tenant)
            block = self._victim(tenant, shares, evict_others)
            self._num_free -= 1
            if block.block_hash is not None:
                self._evict(block)
            block.ref_count, block.owner, block.num_hits = 1, tenant, 0
            block.generation += 1
            self._add(self._num_held, tenant, 1)
            out.append(block)
        if out:  # after the evictions: taking its own last cached block on the way would forget it
            self._weights[tenant] = tenant.weight
        return out

    def free(self, blocks: list[Block]) -> None:
        """Drop one reference each; give blocks in eviction order (a sequence's tail first)."""
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count == 0:
                self._enqueue(block)
                self._num_free += 1
                if block.block_hash is not None:
                    self._add(self._num_idle, block.owner, 1)
                self._add(self._num_held, block.owner, -1)

    def cache(self, block: Block, block_hash: bytes) -> None:
        """Publish a full block under its chain hash; a duplicate of a cached chain stays private."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block
        if self._events is not None:
            self._events.setdefault(block_hash, False)

    def discard(self, block: Block) -> None:
        """Forget a cached block's hash (its content turned out bad): it stays allocated or becomes plainly free."""
        if block.block_hash is None:
            return
        if block.ref_count == 0:
            self._dequeue(block)
            self._evict(block)
            self._enqueue(block)
            return
        del self._cached[block.block_hash]
        if self._events is not None:
            self._events.setdefault(block.block_hash, True)
        block.block_hash = None

    def cached_hashes(self) -> list[bytes]:
        """Every hash the prefix cache holds now: what a publisher writes again when its copy was lost."""
        return list(self._cached)

    def _enqueue(self, block: Block) -> None:
        """Into the free queue a block nobody references waits in, at the back."""
        if not self.shares or block.block_hash is None:
            self._free[block.block_id] = block
            return
        queues = self._idle.get(block.owner)
        if queues is None:
            queues = self._idle[block.owner] = (OrderedDict(), OrderedDict())
        queues[block.num_hits > 0][block.block_id] = block

    def _dequeue(self, block: Block) -> None:
        if not self.shares or block.block_hash is None:
            del self._free[block.block_id]
            return
        once, again = queues = self._idle[block.owner]
        del queues[block.num_hits > 0][block.block_id]
        if not once and not again:
            del self._idle[block.owner]

    def _victim(self, tenant: Tenant, shares: dict[Tenant, float] | None, evict_others: bool) -> Block:
        """Take the next free block to hand out (num_allocatable has said there is one)."""
        if self._free:
            return self._free.popitem(last=False)[1]
        most_over, excess = None, -math.inf  # among the tenants with cached blocks to give
        for owner in self._idle:
            if self._usage(owner) - shares[owner] > excess:
                most_over, excess = owner, self._usage(owner) - shares[owner]
        if excess <= 0 and tenant in self._idle:
            most_over = tenant  # nobody over: the tenant's own before the others'
        elif excess <= 0 and not evict_others:
            raise RuntimeError(
                f"num_allocatable miscounted: tenant {tenant!r} would evict another within its share"
            )
        once, again = self._idle[most_over]
        block = next(iter((once or again).values()))
        self._dequeue(block)
        return block

    def _shares(self, tenant: Tenant) -> dict[Tenant, float]:
        """Each tenant owning blocks, and tenant: its share of the pool in blocks, by weight."""
        # the asking tenant may own blocks taken in this call before its weight is recorded: it has it here
        weights = {
            t: self._weights.get(t, tenant.weight) for t in self._num_held.keys() | self._num_idle.keys()
        }
        weights[tenant] = tenant.weight
        total = sum(weights.values())
        return {t: self.num_blocks * w / total for t, w in weights.items()}

    def _usage(self, tenant: Tenant) -> int:
        return self._num_held.get(tenant, 0) + self._num_idle.get(tenant, 0)

    def _add(self, counts: dict[Tenant, int], tenant: Tenant, n: int) -> None:
        """Count n more for tenant; a tenant owning nothing any more is forgotten, weight and all."""
        left = counts.get(tenant, 0) + n
        if left:
            counts[tenant] = left
            return
        del counts[tenant]
        if tenant not in self._num_held and tenant not in self._num_idle:
            self._weights.pop(tenant, None)

    def _evict(self, block: Block) -> None:
        del self._cached[block.block_hash]
        self._add(self._num_idle, block.owner, -1)
        if self._events is not None:
            self._events.setdefault(block.block_hash, True)
        block.block_hash = None

    def start_recording_events(self) -> None:
        """Start recording cache changes for drain_events (for a pool built by an owner that publishes it)."""
        if self._events is None:
            self._events = {}

    def drain_events(self) -> tuple[list[bytes], list[bytes]]:
        """Hashes newly cached and hashes evicted since the last call, netted: a hash cached then evicted in
        between (or evicted then cached again) appears in neither list."""
        if not self._events:
            return [], []
        added = [h for h, was_cached in self._events.items() if not was_cached and h in self._cached]
        removed = [h for h, was_cached in self._events.items() if was_cached and h not in self._cached]
        self._events = {}
        return added, removed
