"""What another executor's pull reads here (peer_transfer.BlockSource): the leading run of the asked hashes this
executor holds, in the pool or a tier, read on the transfer thread without the engine thread.

The engine thread alone changes the pool and the tiers' indexes, and on a CPU it is busy for a whole step at a
time (a second or more): a pull that waited for it to pin blocks waited that long, and pinned blocks kept the
pool from evicting them for the pull's length. So nothing is pinned. A lease notes each block's generation
(how often it was handed out, executor/kv/block_pool.py) when it finds it; a read copies the block's bytes, then
checks that the block still holds the same hash at the same generation. A block is written only after it is
handed out again, which moves its generation first: a copy that passes the check was taken before any write,
and one that fails ends the run there (the puller computes the rest). Disk files need no check: each names and
checksums its block, and a file gone is a read that fails.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from executor.kv.block_pool import Block

if TYPE_CHECKING:
    from executor.kv.tiers.offloader import KVTiers


class Lease:
    """The blocks one pull may read, as found when it opened."""

    def __init__(self, tiers: KVTiers, hashes: list[bytes], entries: list) -> None:
        # entries: (tier or None for the pool, the block or slot, its generation when found)
        self.tiers, self.hashes, self._entries = tiers, hashes, entries

    def read(self, i: int) -> torch.Tensor:
        tier, block, generation = self._entries[i]
        block_hash = self.hashes[i]
        if tier is None:
            payload = self.tiers.copies.read(block.block_id)
        else:
            payload = self.tiers.read_slot(tier, block, block_hash)
            if payload is None:
                raise LookupError(f"block {block_hash.hex()}: its file is gone or failed its checks")
            if tier is self.tiers.disk:
                return payload
            payload = payload.clone()  # the host slot itself, until copied
        if not _unchanged(block, block_hash, generation):
            raise LookupError(f"block {block_hash.hex()} was evicted while it was read")
        return payload

    def close(self) -> None:
        """Nothing is pinned: nothing to let go of."""


def _unchanged(block: Block, block_hash: bytes, generation: int) -> bool:
    return block.generation == generation and block.block_hash == block_hash


class BlockSource:
    def __init__(self, tiers: KVTiers) -> None:
        self.tiers = tiers

    def open(self, hashes: list[bytes], timeout_s: float) -> Lease:
        """A lease on the leading run of hashes held here, each where it is nearest (pool, host, disk)."""
        tiers, entries = self.tiers, []
        for block_hash in hashes:
            block = tiers.pool.lookup(block_hash)
            tier = None
            if block is None:
                found = tiers.find(block_hash)
                if found is None:
                    break
                tier, block = found
            generation = block.generation
            if not _unchanged(block, block_hash, generation):  # evicted between the lookup and now
                break
            entries.append((tier, block, generation))
        return Lease(tiers, hashes[: len(entries)], entries)
