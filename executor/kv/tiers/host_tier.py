"""The host tier: KV blocks in host memory below the pool, one slot per block, in pinned memory on CUDA so copies
to and from the device run asynchronously.

Its index is a BlockPool over the slots (executor/kv/block_pool.py): the same weighted per-tenant shares and scan
resistance as the pool decide which slot a new block takes. The engine thread alone touches the index; copies
run on the coordinator's workers (offloader.py), on slots the engine thread has pinned.
"""

from __future__ import annotations

import math

import torch

from executor.kv.block_pool import BlockPool


class HostTier:
    name = "host"

    def __init__(
        self,
        capacity_bytes: int,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        pin: bool = False,
        shares: bool = True,
    ) -> None:
        block_bytes = math.prod(block_shape) * dtype.itemsize
        num_slots = capacity_bytes // block_bytes
        if num_slots < 1:
            raise ValueError(
                f"kv_offload_memory: {capacity_bytes} bytes hold no KV block (one takes {block_bytes} bytes)"
            )
        self.block_bytes = block_bytes
        # on the CPU, pages of a large allocation cost nothing until a block lands there; pinned memory (CUDA) is
        # committed at once, which is why the CUDA default is a fixed size and not a share of the machine
        self.slots = torch.empty((num_slots, *block_shape), dtype=dtype, pin_memory=pin)
        self.index = BlockPool(num_slots, shares=shares, record_events=True)

    def write(self, slot: int, payload: torch.Tensor) -> None:
        self.slots[slot].copy_(payload, non_blocking=payload.is_cuda)

    def read(self, slot: int) -> torch.Tensor:
        """The slot's payload, a view: valid while the slot stays pinned."""
        return self.slots[slot]
