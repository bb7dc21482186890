"""The pool of physical KV blocks: ref counts, and the prefix cache of freed-but-still-valid blocks."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False, slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    # set once the block is full and its KV computed; kept after free so the block stays reusable
    block_hash: bytes | None = None


class BlockPool:
    """Owns every block. Free blocks wait in LRU order; a cached one keeps its hash until it is reused."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, record_events: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # ref_count == 0, oldest first: eviction takes from the front, free() appends at the back
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, Block] = {}
        # hash -> whether it was cached when first touched since the last drain; None: nobody publishes the
        # cache (offline use), so nothing accumulates
        self._events: dict[bytes, bool] | None = {} if record_events else None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def lookup(self, block_hash: bytes) -> Block | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on cached blocks a new request reuses."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def allocate(self, n: int) -> list[Block]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_count = 1
            out.append(block)
        return out

    def free(self, blocks: list[Block]) -> None:
        """Drop one reference each; give blocks in eviction order (a sequence's tail first)."""
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block

    def cache(self, block: Block, block_hash: bytes) -> None:
        """Publish a full block under its chain hash; a duplicate of a cached chain stays private."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block
        if self._events is not None:
            self._events.setdefault(block_hash, False)

    def cached_hashes(self) -> list[bytes]:
        """Every hash the prefix cache holds now: what a publisher writes again when its copy was lost."""
        return list(self._cached)

    def _evict(self, block: Block) -> None:
        del self._cached[block.block_hash]
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

    def drain_fresh(self) -> list[int]:
        """Blocks handed out for the first time since the last call."""
        out, self.fresh_block_ids = self.fresh_block_ids, []
        return out
