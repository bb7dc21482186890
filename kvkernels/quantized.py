"""Quantized linear weights: integers with a float scale (and, for GGUF's Q4_1 and K types, an offset) per group
of consecutive inputs of one output row. Both sources land here: --quantization int8 quantizes a float checkpoint
at load time, and a GGUF's quantized blocks convert into it without loss (executor/models/gguf_quantized.py).

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


# --quantized-activations -> the int8 planes the CPU GEMM quantizes its input to (PanelWeight.activation_planes)
ACTIVATION_PLANES = {"float32": 0, "int8": 1, "int16": 2}


@dataclass(frozen=True, slots=True)
class PanelWeight:
    """A QuantizedWeight in the panels the CPU kernel reads (kvkernels/csrc/quantized_gemm_cpu.cpp): values
    [panels, K, 16] int8, or [panels, K, 8] bytes of two 4-bit values each stored plus zero_point (8 for signed
    values, so that they lie in 0..15); scales and offsets [panels, K / group_size, 16], float16 where every one
    of them is exactly a float16 (GGUF's blocks carry float16 scales and offsets: Q4_1 then reads 20 bytes a
    block of 32 weights, not 24), else float32.

    activation_planes: what the GEMM multiplies (ACTIVATION_PLANES): 1, its input quantized to int8 in blocks of
    32 and multiplied as integers (AVX-512 VNNI, as llama.cpp's CPU path does; several times fewer instructions
    than converting the weights to floats, which bound decode steps at a few rows); 2, each block's rounding error
    as a second int8 plane beside it (int16: the float product to about 16 bits, a row's integer work doubled); 0,
    float32. Planes are chosen at packing where the CPU has those instructions and the groups are whole blocks of
    32, else 0."""

    values: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    out_features: int
    group_size: int
    bits: int
    zero_point: int
    activation_planes: int

    @staticmethod
    def pack(weight: QuantizedWeight, ops, activation_planes: int = 1) -> PanelWeight:
        """weight in panels, by the kernels' pack function (ops: kvkernels.cpu_extension.cpu_kernels());
        activation_planes where the CPU and the groups allow them (0: float32 activations always)."""
        zero_point = 8 if weight.bits == 4 and int(weight.values.min()) < 0 else 0
        values, scales, offsets = ops.pack_quantized_weight(
            weight.values, weight.scales, weight.offsets, weight.bits, zero_point
        )
        extras = (scales,) if offsets is None else (scales, offsets)
        if all(torch.equal(t.half().float(), t) for t in extras):
            scales = scales.half()
            offsets = None if offsets is None else offsets.half()
        return PanelWeight(
            values,
            scales,
            offsets,
            weight.shape[0],
            weight.group_size,
            weight.bits,
            zero_point,
            activation_planes if ops.int8_dot_available() and weight.group_size % 32 == 0 else 0,
        )

    @property
    def nbytes(self) -> int:
        """Bytes the GEMM reads, padding to whole panels included."""
        extras = () if self.offsets is None else (self.offsets,)
        return sum(t.numel() * t.element_size() for t in (self.values, self.scales, *extras))

    def _columns(self, panels: torch.Tensor, columns: torch.Tensor) -> QuantizedWeight:
        """The rows (output features) at panels * 16 + columns, unpacked."""
        if self.bits == 8:
            values = self.values[panels, :, columns]
        else:
            nibbles = self.values[panels, :, columns % 8].view(torch.uint8).to(torch.int16)
            high = (columns >= 8).unsqueeze(-1)
            values = (torch.where(high, nibbles >> 4, nibbles & 0xF) - self.zero_point).to(torch.int8)
        offsets = None if self.offsets is None else self.offsets[panels, :, columns].float()
        return QuantizedWeight(
            values, self.scales[panels, :, columns].float(), offsets, self.group_size, self.bits
        )

    def rows(self, rows: torch.Tensor) -> QuantizedWeight:
        """The given output rows as a QuantizedWeight [len(rows), K]."""
        return self._columns(torch.div(rows, 16, rounding_mode="floor"), rows % 16)

    def unpack(self) -> QuantizedWeight:
        return self.rows(torch.arange(self.out_features, device=self.values.device))


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W held quantized: in the CPU kernel's panels once pack() ran (kernels.prepare does
    where the kernels serve float32 on the CPU), else as its QuantizedWeight, dequantized by torch each call."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        # plain attributes: a quantized layout has no place in a state_dict; one of the two forms, never both,
        # since the point is fewer bytes
        self._weight: QuantizedWeight | None = weight
        self._panels: PanelWeight | None = None
        self._ops = None
        self.bias = None if bias is None else bias.detach().float()
        # what the packed GEMM multiplies where the CPU can (--quantized-activations, ACTIVATION_PLANES)
        self.activation_planes = 1

    @property
    def weight_q(self) -> QuantizedWeight:
        return self._weight if self._panels is None else self._panels.unpack()

    @property
    def panels(self) -> PanelWeight | None:
        """The weight in the CPU kernels' panels once pack() ran, else None."""
        return self._panels

    @property
    def nbytes(self) -> int:
        """Bytes of the weight as served (bias aside)."""
        return self._weight.nbytes if self._panels is None else self._panels.nbytes

    def pack(self, ops) -> None:
        """Hold the weight only in the panels of ops (the C++ CPU kernels), whose GEMM then serves float32 input."""
        if self._panels is None:
            packed = PanelWeight.pack(self._weight, ops, self.activation_planes)
            self._panels, self._weight, self._ops = packed, None, ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._panels is not None and x.dtype == torch.float32 and x.device.type == "cpu":
            rows = x.reshape(-1, self.in_features)
            if rows.stride(-1) != 1:
                rows = rows.contiguous()
            p = self._panels
            y = self._ops.quantized_gemm(
                rows,
                p.values,
                p.scales,
                p.offsets,
                self.out_features,
                p.bits,
                p.zero_point,
                self.bias,
                p.activation_planes,
            )
            return y.view(*x.shape[:-1], self.out_features)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return torch.nn.functional.linear(x, self.weight_q.dequantize().to(x.dtype), bias)

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ids of W, as an embedding table tied to this layer looks them up."""
        flat = ids.reshape(-1)
        rows = self._weight_rows(flat).dequantize().to(dtype)
        return rows.view(*ids.shape, self.in_features)

    def _weight_rows(self, ids: torch.Tensor) -> QuantizedWeight:
        if self._panels is not None:
            return self._panels.rows(ids)
        w = self._weight
        offsets = None if w.offsets is None else w.offsets[ids]
        return QuantizedWeight(w.values[ids], w.scales[ids], offsets, w.group_size, w.bits)

    def extra_repr(self) -> str:
        w = self._weight or self._panels
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={w.bits}, "
            f"group_size={w.group_size}, offsets={w.offsets is not None}, bias={self.bias is not None}, "
            f"packed={self._panels is not None}"
        )
