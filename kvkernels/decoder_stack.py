"""A decode step's decoder layers in one C++ call (kvkernels/csrc/decoder_stack_cpu.cpp), for float32 on the CPU
where every linear layer is packed for the C++ kernels: the same kernels in the same order as the model's Python
loop, without that loop's per-layer host work (at one stream about 30% of each token's time)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kvkernels.cpu_extension import cpu_kernels
from kvkernels.cpu_linear import PackedLinear
from kvkernels.quantized import QuantizedLinear


@dataclass(frozen=True, slots=True)
class StackLayer:
    """One pre-norm decoder layer as the stack runs it: norm, qkv, rotary, cache, attention, o, norm, MLP."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv: nn.Module
    o: nn.Module
    gate_up: nn.Module
    down: nn.Module


def _linear_args(module: nn.Module) -> tuple | None:
    """The C++ stack's description of a linear layer packed for the CPU kernels; None for any other."""
    if isinstance(module, PackedLinear) and module.uses_cpu_kernels:
        return (module.packed_weight, None, None, module.bias, module.out_features, 0, 0, 0)
    panels = module.panels if isinstance(module, QuantizedLinear) else None
    if panels is None:
        return None
    return (
        panels.values,
        panels.scales,
        panels.offsets,
        module.bias,
        module.out_features,
        panels.bits,
        panels.zero_point,
        panels.activation_planes,
    )


def build_decoder_stack(
    layers: Sequence[StackLayer], num_heads: int, num_kv_heads: int, head_dim: int, scale: float
):
    """The C++ DecoderStack of these layers, or None where it cannot serve them: the kernels are not built, or a
    layer's weights are not all in their panels (float32 on the CPU, after Kernels.prepare)."""
    ops = cpu_kernels()
    if ops is None or not layers:
        return None
    stack = ops.DecoderStack(num_heads, num_kv_heads, head_dim, scale)
    for layer in layers:
        linears = [_linear_args(m) for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if any(args is None for args in linears):  # panels exist only for float32 on the CPU
            return None
        stack.add_layer(layer.input_norm, layer.post_norm, layer.eps, *linears)
    return stack
