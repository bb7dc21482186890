"""GGUF's quantized blocks as QuantizedWeight (kvkernels/quantized.py), without loss, so a GGUF model serves its own
precision instead of a float32 copy.

Each block type keeps a float scale per group of inputs and small integers: Q8_0 and Q4_0/Q5_0 w = d * q,
Q4_1/Q5_1 w = d * q + m, the K types w = (d * sc) * q - (dmin * m) per sub-block of 32 (Q6_K: (d * sc) * q per 16).
The integers go into QuantizedWeight's values, the products of the block's float16 factors (computed in float32,
as gguf.quants does) into its scales and offsets, so dequantize() gives gguf.quants.dequantize's floats bit for
bit. The block layouts are gguf.quants' (its dequantize_blocks split the same fields in the same order).

The converted model directory (executor/models/gguf_convert.py) keeps these beside its float32 weights, in one
safetensors file (executor/models/model_files.py says where): per weight NAME.values (int8), NAME.scales and
NAME.offsets (float32), and in the metadata each weight's group size, bits and GGUF type.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K
from safetensors import safe_open
from safetensors.numpy import save_file

from kvkernels.quantized import QuantizedWeight
from shared.model_paths import ModelLoadError

_METADATA_KEY = "kvserve.gguf_blocks"


@dataclass(frozen=True, slots=True)
class Fields:
    """One block type's fields, per block: integers [B, block], scales and offsets [B, groups per block]."""

    values: np.ndarray
    scales: np.ndarray
    offsets: np.ndarray | None
    bits: int


def _f16(raw: np.ndarray) -> np.ndarray:
    """A block's float16 factor (two bytes per block) as float32 [B, 1]."""
    return raw.view(np.float16).astype(np.float32)


def _unpack(packed: np.ndarray, width: int, shifts: tuple[int, ...], mask: int) -> np.ndarray:
    """Bit fields in gguf.quants' order: each run of `width` bytes holds len(shifts) consecutive runs of
    `width` values, the first in the lowest bits. [B, bytes] -> [B, bytes * len(shifts)]."""
    n = packed.shape[0]
    kind = packed.dtype.type
    shifted = packed.reshape(n, -1, 1, width) >> np.array(shifts, dtype=kind).reshape(1, 1, -1, 1)
    return (shifted & kind(mask)).reshape(n, -1)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    return _unpack(qs, width, (0, 4), 0x0F)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: one little-endian uint32 per block holds bit 4 of its 32 values."""
    return _unpack(np.ascontiguousarray(qh).view("<u4"), 1, tuple(range(32)), 0x01).astype(np.uint8)


def _q8_0(blocks: np.ndarray) -> Fields:
    return Fields(blocks[:, 2:].view(np.int8), _f16(blocks[:, :2]), None, 8)


def _q4_0(blocks: np.ndarray) -> Fields:
    q = _nibbles(blocks[:, 2:], 16).astype(np.int8) - np.int8(8)
    return Fields(q, _f16(blocks[:, :2]), None, 4)


def _q4_1(blocks: np.ndarray) -> Fields:
    return Fields(_nibbles(blocks[:, 4:], 16).astype(np.int8), _f16(blocks[:, :2]), _f16(blocks[:, 2:4]), 4)


def _q5_0(blocks: np.ndarray) -> Fields:
    q = (_nibbles(blocks[:, 6:], 16) | (_fifth_bits(blocks[:, 2:6]) << np.uint8(4))).astype(np.int8)
    return Fields(q - np.int8(16), _f16(blocks[:, :2]), None, 8)


def _q5_1(blocks: np.ndarray) -> Fields:
    q = (_nibbles(blocks[:, 8:], 16) | (_fifth_bits(blocks[:, 4:8]) << np.uint8(4))).astype(np.int8)
    return Fields(q, _f16(blocks[:, :2]), _f16(blocks[:, 2:4]), 8)


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: d * sc and -(dmin * m) for each sub-block of 32, from the 12 bytes of 6-bit sc and m."""
    sc, m = Q4_K.get_scale_min(blocks[:, 4 : 4 + Q4_K.K_SCALE_SIZE])
    return _f16(blocks[:, :2]) * sc.astype(np.float32), -(_f16(blocks[:, 2:4]) * m.astype(np.float32))


def _q4_k(blocks: np.ndarray) -> Fields:
    scales, offsets = _k_scales(blocks)
    return Fields(_nibbles(blocks[:, 16:], 32).astype(np.int8), scales, offsets, 4)


def _q5_k(blocks: np.ndarray) -> Fields:
    scales, offsets = _k_scales(blocks)
    high = _unpack(blocks[:, 16:48], 32, tuple(range(8)), 0x01)
    q = _nibbles(blocks[:, 48:], 32) | (high << np.uint8(4))
    return Fields(q.astype(np.int8), scales, offsets, 8)


def _q6_k(blocks: np.ndarray) -> Fields:
    low, high = _nibbles(blocks[:, :128], 64), _unpack(blocks[:, 128:192], 32, (0, 2, 4, 6), 0x03)
    q = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    scales = _f16(blocks[:, 208:]) * blocks[:, 192:208].view(np.int8).astype(np.float32)
    return Fields(q, scales, None, 8)


# GGUF type -> its block's fields; any other type (float ones, Q2_K, Q3_K, the IQ types) is served as float32.
_BLOCK_TYPES: dict[GGMLQuantizationType, Callable[[np.ndarray], Fields]] = {
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q5_0: _q5_0,
    GGMLQuantizationType.Q5_1: _q5_1,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}


def converts(qtype: GGMLQuantizationType) -> bool:
    return qtype in _BLOCK_TYPES


def quantized_weight(data: np.ndarray, qtype: GGMLQuantizationType) -> QuantizedWeight:
    """A GGUF tensor's bytes [rows, bytes per row] (GGUFReader's tensor.data) as the [rows, inputs] weight."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if data.ndim != 2 or data.dtype != np.uint8 or data.shape[1] % type_size:
        raise ValueError(
            f"{qtype.name} data must be uint8 [rows, whole blocks], got {data.dtype} {data.shape}"
        )
    rows, inputs = data.shape[0], data.shape[1] // type_size * block_size
    fields = _BLOCK_TYPES[qtype](np.ascontiguousarray(data).reshape(-1, type_size))
    group = block_size // fields.scales.shape[1]

    def tensor(array: np.ndarray, columns: int) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array).reshape(rows, columns))

    return QuantizedWeight(
        tensor(fields.values, inputs),
        tensor(fields.scales, inputs // group),
        None if fields.offsets is None else tensor(fields.offsets, inputs // group),
        group,
        fields.bits,
    )


def take_rows(weight: QuantizedWeight, rows: torch.Tensor) -> QuantizedWeight:
    """The weight's rows in the order `rows` gives; a row moves whole, so nothing changes in value."""
    return QuantizedWeight(
        weight.values[rows].contiguous(),
        weight.scales[rows].contiguous(),
        None if weight.offsets is None else weight.offsets[rows].contiguous(),
        weight.group_size,
        weight.bits,
    )


def save_blocks(weights: dict[str, tuple[QuantizedWeight, str]], path: Path) -> None:
    """weights: HF name -> (its quantized weight, the GGUF type it came from)."""
    tensors, layout = {}, {}
    for name, (weight, qtype) in weights.items():
        tensors[f"{name}.values"] = weight.values.numpy()
        tensors[f"{name}.scales"] = weight.scales.numpy()
        if weight.offsets is not None:
            tensors[f"{name}.offsets"] = weight.offsets.numpy()
        layout[name] = {"group_size": weight.group_size, "bits": weight.bits, "gguf_type": qtype}
    save_file(tensors, path, metadata={"format": "pt", _METADATA_KEY: json.dumps(layout)})


def load_blocks(path: Path) -> dict[str, QuantizedWeight]:
    """HF name -> quantized weight, as save_blocks wrote them."""
    with safe_open(path, framework="pt") as blocks:
        metadata = blocks.metadata() or {}
        if _METADATA_KEY not in metadata:
            raise ModelLoadError(f"{path} lacks its {_METADATA_KEY!r} metadata: convert the GGUF again")
        names = set(blocks.keys())
        weights = {}
        for name, layout in json.loads(metadata[_METADATA_KEY]).items():
            offsets = f"{name}.offsets"
            weights[name] = QuantizedWeight(
                blocks.get_tensor(f"{name}.values"),
                blocks.get_tensor(f"{name}.scales"),
                blocks.get_tensor(offsets) if offsets in names else None,
                layout["group_size"],
                layout["bits"],
            )
    return weights
