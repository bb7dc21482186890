"""Linear layers whose weights are packed once into oneDNN's blocked layout, for float32 on CPU.

Decode steps multiply a few dozen rows by every weight matrix; torch's default GEMM re-packs the weight on each
call, which at 32 rows costs about as much as the arithmetic (the 49k-row LM head ran at ~40 GFLOP/s instead of
~110 here). Packing once at load time removes that. Large prefill chunks run at the same speed either way.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kernels.cpu_extension import kernels_enabled

log = logging.getLogger("kvserve.kernels")

# oneDNN picks the packed layout for a typical row count; any count works with it
_ROWS_HINT = 32


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """float32 on a CPU with oneDNN, unless KVSERVE_CPU_KERNELS=0."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and kernels_enabled()
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear(nn.Module):
    """y = x W^T + b with W held only in oneDNN's packed layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # plain attributes: an opaque oneDNN tensor has no place in a state_dict
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), _ROWS_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.packed_weight, self.bias, "none", [], ""
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def pack_linears(model: nn.Module) -> int:
    """Swap every nn.Linear inside model for a PackedLinear; returns how many were swapped."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    log.info("packed %d linear layers for oneDNN", len(swaps))
    return len(swaps)
