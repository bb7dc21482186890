"""The torch backend's per-layer operations besides attention: the residual add fused with RMSNorm, rotary
embedding, SiLU(gate) * up and LoRA's update of rows grouped by adapter. On the CPU in float32 the C++ kernels
(kvkernels/csrc/fused_cpu.cpp, lora_cpu.cpp) run each in one call; elsewhere, or where they could not be built,
torch ops compute the same."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvkernels import torch_twins
from kvkernels.cpu_extension import cpu_kernels


def cpu_kernels_for(x: torch.Tensor):
    """The C++ kernels where they serve x (float32 on the CPU), else None."""
    return cpu_kernels() if x.device.type == "cpu" and x.dtype == torch.float32 else None


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); unfused, the add then torch's own rms_norm."""
    ops = cpu_kernels_for(x)
    if ops is not None and x.is_contiguous() and residual.is_contiguous() and weight.dtype == torch.float32:
        return ops.add_rms_norm(x, residual, weight, eps)
    summed = x + residual
    return F.rms_norm(summed, (summed.shape[-1],), weight, eps), summed


def rotary_embedding(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding of query [T, Hq, D] and key [T, Hkv, D]; the CPU kernel rotates them in
    place (they are fresh projections), the torch twin returns new tensors."""
    ops = cpu_kernels_for(query)
    if ops is not None and key.dtype == torch.float32 and cos.dtype == torch.float32:
        ops.rotary_embedding_(query, key, cos.contiguous(), sin.contiguous())
        return query, key
    return torch_twins.rotary_embedding(query, key, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate, then up) -> silu(gate) * up, [T, I]."""
    ops = cpu_kernels_for(x)
    if ops is not None and x.stride(-1) == 1:
        return ops.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def lora_add(x: torch.Tensor, out: torch.Tensor, groups) -> None:
    """out += each group's LoRA update of its rows of x (torch_twins.lora_add says the groups' form); the C++
    kernel takes every group in one call where each group's rows are one slice."""
    ops = cpu_kernels_for(x)
    if (
        ops is not None
        and out.dtype == torch.float32
        and x.stride(-1) == 1
        and out.stride(-1) == 1
        and all(isinstance(rows, slice) for rows, _, _ in groups)
    ):
        ops.lora_add_(x, out, [(rows.start, rows.stop, a, parts) for rows, a, parts in groups])
        return
    torch_twins.lora_add(x, out, groups)
