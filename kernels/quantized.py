"""Quantized linear weights: integers with a float scale (and, for GGUF's Q4_1 and K types, an offset) per group
of consecutive inputs of one output row. Both sources land here: --quantization int8 quantizes a float checkpoint
at load time, and a GGUF's quantized blocks convert into it without loss (executor/gguf_quantized.py).

w[n, k] = values[n, k] * scales[n, k // group_size] (+ offsets[n, k // group_size])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A [N, K] weight as integers in int8 storage (bits 8: -128..127; bits 4: values fit in 4 bits, -8..7 or
    0..15) and float32 scales and optional offsets of shape [N, K // group_size]."""

    values: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    group_size: int
    bits: int

    def __post_init__(self) -> None:
        n, k = self.values.shape
        if self.values.dtype != torch.int8:
            raise ValueError(f"quantized values must be int8, got {self.values.dtype}")
        if self.bits not in (4, 8):
            raise ValueError(f"quantized weights have 4 or 8 bits, got {self.bits}")
        if self.group_size <= 0 or k % self.group_size:
            raise ValueError(f"group size {self.group_size} does not divide the {k} inputs")
        groups = (n, k // self.group_size)
        if tuple(self.scales.shape) != groups or self.scales.dtype != torch.float32:
            raise ValueError(
                f"scales must be float32 {groups}, got {self.scales.dtype} {tuple(self.scales.shape)}"
            )
        if self.offsets is not None and (
            tuple(self.offsets.shape) != groups or self.offsets.dtype != torch.float32
        ):
            raise ValueError(f"offsets must be float32 {groups}, got {tuple(self.offsets.shape)}")

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def nbytes(self) -> int:
        """Bytes of the weight as served: 4-bit values count half a byte each."""
        values = self.values.numel() * self.bits // 8
        extras = self.scales.numel() * (2 if self.offsets is not None else 1)
        return values + 4 * extras

    def dequantize(self) -> torch.Tensor:
        """The float32 [N, K] matrix these integers stand for."""
        n, k = self.values.shape
        grouped = self.values.view(n, -1, self.group_size).float() * self.scales.unsqueeze(-1)
        if self.offsets is not None:
            grouped += self.offsets.unsqueeze(-1)
        return grouped.view(n, k)

    @staticmethod
    def cat(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """Rows stacked (q/k/v into one projection): the parts must share group size, bits and offsets' presence."""
        first = parts[0]
        if any(
            (p.group_size, p.bits, p.offsets is None) != (first.group_size, first.bits, first.offsets is None)
            for p in parts
        ):
            raise ValueError("stacked quantized weights differ in group size, bits or offsets")
        return QuantizedWeight(
            torch.cat([p.values for p in parts]),
            torch.cat([p.scales for p in parts]),
            None if first.offsets is None else torch.cat([p.offsets for p in parts]),
            first.group_size,
            first.bits,
        )


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> QuantizedWeight:
    """Symmetric int8 with one scale per output row (group_size None) or per group of inputs: the largest
    magnitude of each group maps to 127."""
    n, k = weight.shape
    group = k if group_size is None else group_size
    grouped = weight.detach().float().reshape(n, k // group, group)
    scales = grouped.abs().amax(dim=-1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = torch.round(grouped / scales.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(values.view(n, k), scales.contiguous(), None, group, 8)


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W held quantized."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight_q = weight  # a plain attribute: a quantized layout has no place in a state_dict
        self.bias = None if bias is None else bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight_q.dequantize().to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        w = self.weight_q
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={w.bits}, "
            f"group_size={w.group_size}, offsets={w.offsets is not None}, bias={self.bias is not None}"
        )
