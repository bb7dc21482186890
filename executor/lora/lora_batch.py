"""A step's LoRA work: which rows of the flattened batch run under which adapter.

Every base projection runs once for all rows; then, per adapter in the step, its rows' low-rank update is added to
that projection's output: a shrink (the rows times the stacked A matrices) and an expand per targeted part (into
the part's output columns), as Punica's SGMV groups rows by adapter, every group in one kernel call (the model's
kernels' lora_add, kvkernels/backend.py). Rows of the base model have no group.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvkernels.layer_ops import lora_add

if TYPE_CHECKING:
    from executor.lora.adapter_files import LoRAAdapter

# the C++ decoder stack's projection numbers (kvkernels/csrc/decoder_stack_cpu.h)
STACK_PROJECTIONS = {
    "self_attn.qkv_proj": 0,
    "self_attn.o_proj": 1,
    "mlp.gate_up_proj": 2,
    "mlp.down_proj": 3,
}
STACK_ADAPTERS = 64  # adapters a stack keeps registered; the least recently used beyond are dropped


@dataclass(slots=True)
class LoRAGroup:
    adapter: LoRAAdapter
    rows: torch.Tensor | slice  # the group's rows: a slice where they are contiguous, else an int64 index


class LoRABatch:
    def __init__(self, groups: list[LoRAGroup], kernel: Callable[..., None] = lora_add) -> None:
        self.groups = groups
        self.kernel = kernel  # (x, out, groups): kvkernels/torch_twins.py lora_add's form

    @classmethod
    def of_chunks(
        cls,
        adapters: list[LoRAAdapter | None],
        query_start,
        device: torch.device,
        kernel: Callable[..., None] = lora_add,
    ) -> LoRABatch | None:
        """From each chunk's adapter (None: the base model) and where each chunk's rows start (query_start,
        one more than chunks), the update run by kernel; None when no chunk has an adapter."""
        by_name: dict[str, tuple[LoRAAdapter, list[range]]] = {}
        for i, adapter in enumerate(adapters):
            if adapter is not None:
                rows = range(int(query_start[i]), int(query_start[i + 1]))
                by_name.setdefault(adapter.name, (adapter, []))[1].append(rows)
        if not by_name:
            return None
        groups = []
        for adapter, ranges in by_name.values():
            if all(a.stop == b.start for a, b in zip(ranges, ranges[1:], strict=False)):
                groups.append(LoRAGroup(adapter, slice(ranges[0].start, ranges[-1].stop)))
            else:
                rows = [row for r in ranges for row in r]
                groups.append(LoRAGroup(adapter, torch.tensor(rows, dtype=torch.int64, device=device)))
        return cls(groups, kernel)

    def add(self, layer: int, projection: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out (projection's output for every row) += each group's low-rank update of its rows of x."""
        groups = []
        for group in self.groups:
            lora = group.adapter.layers[layer].get(projection)
            if lora is not None:
                groups.append((group.rows, lora.a, lora.parts))
        if groups:
            self.kernel(x, out, groups)


class StackAdapters:
    """The adapters registered with one C++ decoder stack (kvkernels/decoder_stack.py), by identity: a step of
    decodes under adapters runs in the stack too, its groups named by the ids given here."""

    def __init__(self, stack) -> None:
        self.stack = stack
        self._ids: OrderedDict[str, int] = OrderedDict()  # identity -> id, least recently used first
        self._next_id = 0

    def groups(self, lora: LoRABatch) -> list[tuple[int, int, int]] | None:
        """The step's groups as the stack takes them, (first row, last + 1, id); None when a group's rows are
        not one slice (the Python loop then runs the step)."""
        if not all(isinstance(group.rows, slice) for group in lora.groups):
            return None
        return [(g.rows.start, g.rows.stop, self._id(g.adapter)) for g in lora.groups]

    def _id(self, adapter: LoRAAdapter) -> int:
        key = adapter.identity
        if key in self._ids:
            self._ids.move_to_end(key)
            return self._ids[key]
        layers = [
            [(STACK_PROJECTIONS[name], p.a, list(p.parts)) for name, p in projections.items()]
            for projections in adapter.layers
        ]
        self._next_id += 1
        self.stack.add_adapter(self._next_id, layers)
        self._ids[key] = self._next_id
        if len(self._ids) > STACK_ADAPTERS:
            _, dropped = self._ids.popitem(last=False)
            self.stack.drop_adapter(dropped)
        return self._next_id
