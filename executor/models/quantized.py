"""A built model's linear layers and embedding served from quantized weights (kvkernels/quantized.py): the ones a
checkpoint hands over as QuantizedWeight replace the float modules the model was built with."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from kvkernels.quantized import QuantizedLinear, QuantizedWeight
from kvkernels.weight_quantization import TiedEmbedding


def stack(parts: Sequence[torch.Tensor | QuantizedWeight]) -> torch.Tensor | QuantizedWeight:
    """Projections stacked by rows (q/k/v, gate/up). Quantized parts in different layouts (a Q4_K_M file's
    Q6_K attn_v beside Q4_K attn_q) are first brought to one layout that holds each exactly; a float part
    beside quantized ones makes the whole stack float."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    if any(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat([p if isinstance(p, torch.Tensor) else p.dequantize() for p in parts])
    group = math.gcd(*(p.group_size for p in parts))
    bits = max(p.bits for p in parts)
    offsets = any(p.offsets is not None for p in parts)
    return QuantizedWeight.cat([_relayout(p, group, bits, offsets) for p in parts])


def _relayout(weight: QuantizedWeight, group: int, bits: int, offsets: bool) -> QuantizedWeight:
    """The same weight with groups split to `group` inputs, `bits` and offsets (zero where it had none):
    each value keeps its scale and offset, so it dequantizes to the same number."""
    if (weight.group_size, weight.bits, weight.offsets is not None) == (group, bits, offsets):
        return weight
    split = weight.group_size // group
    scales = weight.scales.repeat_interleave(split, dim=1)
    offset = weight.offsets if weight.offsets is not None else torch.zeros_like(weight.scales)
    return QuantizedWeight(
        weight.values, scales, offset.repeat_interleave(split, dim=1) if offsets else None, group, bits
    )


def to_device(weight: QuantizedWeight, device: torch.device) -> QuantizedWeight:
    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    return QuantizedWeight(
        move(weight.values), move(weight.scales), move(weight.offsets), weight.group_size, weight.bits
    )


def place_quantized(
    model: nn.Module,
    weights: dict[str, QuantizedWeight],
    tied: bool,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """Each `MODULE.weight` in weights replaces its nn.Linear (keeping the bias already loaded) or nn.Embedding.
    A quantized embedding table looks up only the batch's rows in a QuantizedLinear's weight (TiedEmbedding), so
    it costs its quantized bytes rather than a float copy; tied, that layer is the LM head. Call after the float
    tensors are loaded."""
    for name, weight in weights.items():
        path = name.removesuffix(".weight")
        module = model.get_submodule(path)
        weight = to_device(weight, device)
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        if isinstance(module, nn.Linear):
            setattr(
                parent, child, QuantizedLinear(weight, None if module.bias is None else module.bias.to(dtype))
            )
        elif isinstance(module, nn.Embedding):
            table = QuantizedLinear(weight)
            setattr(parent, child, TiedEmbedding(table, dtype))
            if tied:
                model.lm_head = table
        else:
            raise ValueError(
                f"checkpoint tensor {name!r} is quantized, but {path} is a {type(module).__name__}"
            )
