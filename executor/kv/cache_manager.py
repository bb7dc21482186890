"""Block tables per request: prefix-cache lookups, on-demand allocation, caching of full blocks, freeing.

It reads a request's num_computed_tokens but never moves it: that is the scheduler's bookkeeping.

Besides each request's list of Block objects (what ref counts and the prefix cache work on), the ids live in
one int32 array, a row per request holding blocks, written when blocks are added: a step's batch copies rows
out of it instead of rebuilding every request's table from Python objects each step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from executor.kv.block_pool import Block, BlockPool
from executor.request import Request, RequestStatus
from shared.block_hash import hash_blocks, max_cached_blocks
from shared.tenant import Tenant


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """What a prefix-cache lookup found for a request: its blocks stay the manager's business, the scheduler
    reads how many tokens they cover and hands the handle back to allocate()."""

    blocks: tuple[Block, ...] = ()
    block_size: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size

    def __len__(self) -> int:
        return len(self.blocks)


NO_PREFIX = CachedPrefix()


class KVCacheManager:
    def __init__(
        self, pool: BlockPool, block_size: int, max_blocks_per_seq: int = 64, rows: int = 64
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.tables: dict[str, list[Block]] = {}
        # per request: how many leading blocks of its table are already published in the prefix cache
        self._num_cached: dict[str, int] = {}
        self.block_table = np.zeros((rows, max_blocks_per_seq), dtype=np.int32)  # both grow when needed
        self._row_of: dict[str, int] = {}
        self._free_rows = list(range(rows - 1, -1, -1))
        # (source, destination) block ids whose KV the model runner must copy before the next forward pass:
        # copy-on-write of a block that forked choices share and one of them is about to write into
        self.pending_copies: list[tuple[int, int]] = []
        # how many of a tenant's blocks only the KV tiers' pins hold (executor/kv/tiers/offloader.py), no request:
        # they do not make it a tenant with work running (may_evict_others)
        self.held_by_pins: Callable[[Tenant], int] = lambda tenant: 0
        # told of the cached blocks each started request takes: the tiers' reuse admission counts them as reused
        self.prefix_hit: Callable[[tuple[Block, ...]], None] = lambda blocks: None

    def block_ids(self, request: Request) -> np.ndarray:
        """The request's block ids, a view into block_table: valid until its blocks change."""
        row = self._row_of.get(request.request_id)
        if row is None:
            return self.block_table[0, :0]
        return self.block_table[row, : len(self.tables[request.request_id])]

    def num_blocks(self, request: Request) -> int:
        return len(self.tables.get(request.request_id, ()))

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """The longest run of cached blocks at the head of the request, never covering its last token."""
        if not self.pool.enable_caching:
            return NO_PREFIX
        hit = []
        for block_hash in self.cacheable_hashes(request):
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hit.append(block)
        return CachedPrefix(tuple(hit), self.block_size)

    def cacheable_hashes(self, request: Request) -> list[bytes]:
        """The hashes of the request's leading blocks that a cache may supply: never its last token's block."""
        self._update_hashes(request)
        limit = max_cached_blocks(request.num_tokens, self.block_size)
        if request.num_prompt_tokens_to_score:
            # a cached block has KV but no logits: only positions whose next token is scored may come from it
            limit = min(limit, (request.num_scored_prompt_tokens - 1) // self.block_size)
        return request.block_hashes[:limit]

    def allocate(
        self, request: Request, num_new_tokens: int, cached: CachedPrefix = NO_PREFIX, reserve: int = 0
    ) -> bool:
        """Make room for num_new_tokens more tokens past the computed ones and the cached prefix, which joins
        the table; False if the pool is short, or would keep fewer than reserve blocks free (a group's choices
        still to fork each need one soon). The caller counts the prefix as computed. A block the new tokens
        land in that forked choices still share is first copied (copy-on-write). Whose cached blocks it may
        evict: see may_evict_others."""
        cached_prefix = cached.blocks
        table = self.tables.get(request.request_id, [])
        first_written = request.num_computed_tokens + cached.num_tokens
        num_tokens = first_written + num_new_tokens
        num_needed = -(-num_tokens // self.block_size) - len(table) - len(cached_prefix)
        shared = [
            i
            for i in range(
                first_written // self.block_size, min(len(table), -(-num_tokens // self.block_size))
            )
            if table[i].ref_count > 1
        ]
        # cached blocks nobody holds sit in the free queue: taking them shrinks what is left to allocate
        num_reclaimed = sum(1 for b in cached_prefix if b.ref_count == 0)
        evict_others = self.may_evict_others(request)
        room = self.pool.num_allocatable(request.tenant, evict_others) - num_reclaimed
        if max(num_needed, 0) + len(shared) + reserve > room:
            return False
        old_len = len(table)
        if shared:
            table = self._copy_on_write(request, table, shared, evict_others)
        if cached_prefix:
            self.pool.touch(list(cached_prefix))
            self.prefix_hit(cached_prefix)
            table = table + list(cached_prefix)
            self._num_cached[request.request_id] = len(cached_prefix)
        if num_needed > 0:
            table = table + self.pool.allocate(num_needed, request.tenant, evict_others)
        self.tables[request.request_id] = table
        if shared:
            self._write_row(request.request_id, shared[0], table)
        elif len(table) > old_len:
            self._write_row(request.request_id, old_len, table)
        return True

    def may_evict_others(self, request: Request) -> bool:
        """Whether the request may take other tenants' cached blocks within their shares (block_pool.py). A
        running request may: running requests never starve for blocks. So may a new request of a tenant holding
        none, or one needing more than its share could wait forever, nothing of its own running to give blocks
        back. A tenant's other new requests wait for blocks it, or tenants over their shares, give up: a burst
        waits behind itself."""
        if request.status is RequestStatus.RUNNING:
            return True
        return self.pool.num_held(request.tenant) == self.held_by_pins(request.tenant)

    def _copy_on_write(
        self, request: Request, table: list[Block], shared: list[int], evict_others: bool
    ) -> list[Block]:
        """The table with its shared blocks at these positions replaced by private copies of them."""
        table = list(table)
        copies = self.pool.allocate(len(shared), request.tenant, evict_others)
        self.pool.free([table[i] for i in shared])  # the siblings keep theirs
        for i, copy in zip(shared, copies, strict=True):
            self.pending_copies.append((table[i].block_id, copy.block_id))
            table[i] = copy
        return table

    def fork(self, parent: Request, child: Request) -> None:
        """child shares every block of parent's table by reference; whichever writes into a shared block first
        copies it then (allocate). Both must have the same tokens computed."""
        table = list(self.tables.get(parent.request_id, []))
        self.pool.share(table)
        self.tables[child.request_id] = table
        self._num_cached[child.request_id] = self._num_cached.get(parent.request_id, 0)
        child.block_hashes = list(parent.block_hashes)
        if table:
            self._write_row(child.request_id, 0, table)

    def drain_copies(self) -> list[tuple[int, int]]:
        out, self.pending_copies = self.pending_copies, []
        return out

    def _write_row(self, request_id: str, start: int, table: list[Block]) -> None:
        row = self._row_of.get(request_id)
        if row is None:
            if not self._free_rows:
                grown = self.block_table.shape[0]
                self.block_table = np.vstack([self.block_table, np.zeros_like(self.block_table)])
                self._free_rows = list(range(2 * grown - 1, grown - 1, -1))
            row = self._row_of[request_id] = self._free_rows.pop()
        if len(table) > self.block_table.shape[1]:
            width = max(len(table), 2 * self.block_table.shape[1])
            self.block_table = np.pad(self.block_table, ((0, 0), (0, width - self.block_table.shape[1])))
        self.block_table[row, start : len(table)] = [b.block_id for b in table[start:]]

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the blocks whose every token now has its KV computed."""
        if not self.pool.enable_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        done = self._num_cached.get(request.request_id, 0)
        if num_full <= done:
            return
        self._update_hashes(request)
        table = self.tables[request.request_id]
        for i in range(done, num_full):
            self.pool.cache(table[i], request.block_hashes[i])
        self._num_cached[request.request_id] = num_full

    def free(self, request: Request) -> None:
        table = self.tables.pop(request.request_id, [])
        self._num_cached.pop(request.request_id, None)
        row = self._row_of.pop(request.request_id, None)
        if row is not None:
            self._free_rows.append(row)
        # tail first, so the blocks least likely to be shared are evicted first
        self.pool.free(table[::-1])

    def num_tokens_stored(self, requests: list[Request]) -> int:
        """Tokens whose KV these requests' blocks hold, a block shared by several counted once."""
        filled: dict[int, int] = {}
        for request in requests:
            for i, block in enumerate(self.tables.get(request.request_id, [])):
                n = min(self.block_size, max(0, request.num_computed_tokens - i * self.block_size))
                filled[block.block_id] = max(filled.get(block.block_id, 0), n)
        return sum(filled.values())

    def _update_hashes(self, request: Request) -> None:
        if len(request.block_hashes) < request.num_tokens // self.block_size:
            request.block_hashes = hash_blocks(
                request.token_ids, self.block_size, request.cache_salt, request.block_hashes
            )
