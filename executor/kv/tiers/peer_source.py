"""What another executor's pull reads here (peer_transfer.BlockSource): the leading run of the asked hashes this
executor holds, in the pool or a tier, pinned by the engine thread for the transfer thread to read.

Each open is one pin request the engine thread serves at its next poll (KVTiers.poll, also called between steps
while idle); the lease's close hands the unpinning back the same way.
"""

from __future__ import annotations

from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from executor.kv.tiers.offloader import KVTiers


class Lease:
    """Blocks pinned for one pull: read from the transfer thread, closed once."""

    def __init__(self, tiers: KVTiers, hashes: list[bytes], entries: list) -> None:
        self.tiers, self.hashes, self._entries = (
            tiers,
            hashes,
            entries,
        )  # entries: (tier or None: pool, block)
        self._closed = False

    def read(self, i: int) -> torch.Tensor:
        tier, block = self._entries[i]
        if tier is None:
            return self.tiers.copies.read(block.block_id)
        payload = tier.read_payload(block, self.hashes[i])
        if payload is None:
            raise LookupError(f"block {self.hashes[i].hex()} failed its checks on disk")
        return payload

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            entries = self._entries
            self.tiers.run_on_engine_thread(lambda: unpin(self.tiers, entries))


def pin(tiers: KVTiers, hashes: list[bytes]) -> Lease:
    """Engine thread: pin the leading run of hashes held here, each where it is nearest (pool, host, disk)."""
    entries = []
    for block_hash in hashes:
        block = tiers.pool.lookup(block_hash)
        if block is not None:
            tiers.pin([block])
            entries.append((None, block))
            continue
        found = tiers.find(block_hash)
        if found is None:
            break
        found[0].index.share([found[1]])
        entries.append(found)
    return Lease(tiers, hashes[: len(entries)], entries)


def unpin(tiers: KVTiers, entries: list) -> None:
    for tier, block in entries:
        if tier is None:
            tiers.unpin([block])
        else:
            tier.index.free([block])


class BlockSource:
    def __init__(self, tiers: KVTiers) -> None:
        self.tiers = tiers

    def open(self, hashes: list[bytes], timeout_s: float) -> Lease | None:
        """A lease on what of hashes is here, None when the engine thread did not get to it in timeout_s."""
        future: Future = Future()

        def pin_now() -> None:
            if future.set_running_or_notify_cancel():  # False: the transfer gave up waiting
                future.set_result(pin(self.tiers, hashes))

        self.tiers.run_on_engine_thread(pin_now)
        try:
            return future.result(timeout_s)
        except FutureTimeout:
            if future.cancel():
                return None
            return future.result()  # pinned just now: the caller reads it (and closes it)
