"""Linear layers whose weights are packed once at load time, for float32 on CPU.

Decode steps multiply a few dozen rows by every weight matrix; torch's default GEMM re-packs the weight on each
call, which at 32 rows costs about as much as the arithmetic. Packing once removes that. Where the C++ kernels
are built, the weight goes into the panels of kvkernels/csrc/small_gemm_cpu.cpp, whose GEMM streams each weight
once per call at full speed (at 16 rows 30% less time than oneDNN's, level or ahead at 512); otherwise into
oneDNN's blocked layout.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kvkernels.cpu_extension import cpu_kernels, kernels_enabled
from kvkernels.quantized import QuantizedLinear

log = logging.getLogger("kvserve.kernels")

# oneDNN picks the packed layout for a typical row count; any count works with it
_ROWS_HINT = 32


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """float32 on a CPU with the C++ kernels or oneDNN, unless KVSERVE_CPU_KERNELS=0."""
    onednn = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and kernels_enabled()
        and (onednn or cpu_kernels() is not None)
    )


class PackedLinear(nn.Module):
    """y = x W^T + b with W held only in its packed layout (the kernels' panels, else oneDNN's)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else linear.bias.detach()
        # plain attributes: a packed layout has no place in a state_dict
        self._ops = cpu_kernels()
        weight = linear.weight.detach()
        if self._ops is not None:
            self.packed_weight = self._ops.pack_gemm_weight(weight.contiguous())
        else:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, _ROWS_HINT)

    @property
    def uses_cpu_kernels(self) -> bool:
        """Whether the weight is in the C++ kernels' panels (else oneDNN's layout)."""
        return self._ops is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        if self._ops is not None:
            y = self._ops.small_gemm(rows, self.packed_weight, self.out_features, self.bias)
        else:
            y = torch.ops.mkldnn._linear_pointwise(
                rows.contiguous(), self.packed_weight, self.bias, "none", [], ""
            )
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def pack_linears(model: nn.Module) -> int:
    """Swap every nn.Linear inside model for a PackedLinear, and put every QuantizedLinear's weight into the
    kernels' panels where they are built; returns how many float layers were swapped."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    layout = "oneDNN's blocked layout" if cpu_kernels() is None else "the CPU kernels' panels"
    log.info("packed %d linear layers into %s", len(swaps), layout)
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    if quantized and cpu_kernels() is not None:
        for layer in quantized:
            layer.pack(cpu_kernels())
        log.info("packed %d quantized linear layers into the CPU kernels' integer panels", len(quantized))
    return len(swaps)
