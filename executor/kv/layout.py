"""The paged KV cache's layout, in one place: every layer's K and V blocks in one tensor
[layers, K/V, blocks, block_size, KV heads, head_dim], so that copying a block (copy-on-write) is one indexed copy
and each layer's kernels see [blocks, block_size, KV heads, head_dim] views."""

from __future__ import annotations

import math

import torch

from executor.models.llama import DecoderSpec


def kv_cache_shape(spec: DecoderSpec, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)


def kv_block_bytes(spec: DecoderSpec, block_size: int, dtype: torch.dtype) -> int:
    """What one block costs, every layer's K and V."""
    return math.prod(kv_cache_shape(spec, 1, block_size)) * dtype.itemsize


def copy_blocks(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Each source block's K and V, every layer, into its destination block."""
    kv_cache[:, :, dst] = kv_cache[:, :, src]


def layer_caches(kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (key cache, value cache): views into the one tensor."""
    return [(kv_cache[i, 0], kv_cache[i, 1]) for i in range(kv_cache.shape[0])]
