"""Writing the step's new K/V into their cache slots in Triton: one program per token, all its KV heads."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvkernels.triton_mode import check_device


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcn,
    stride_kcb,
    stride_kch,
    stride_vcn,
    stride_vcb,
    stride_vch,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    block = slot // BLOCK_SIZE
    within = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    # a negative slot marks a padding token (a CUDA graph's batch padded to its size): no head of it is written
    heads = tl.where(slot >= 0, NUM_HEADS, 0)
    mask = (offs_h[:, None] < heads) & (offs_d[None, :] < HEAD_DIM)
    key = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    value = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    key_dst = key_cache_ptr + block * stride_kcn + within * stride_kcb
    value_dst = value_cache_ptr + block * stride_vcn + within * stride_vcb
    tl.store(key_dst + offs_h[:, None] * stride_kch + offs_d[None, :], key, mask=mask)
    tl.store(value_dst + offs_h[:, None] * stride_vch + offs_d[None, :], value, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value [T,Hkv,D] into caches [N,B,Hkv,D] at slot_mapping[T] int64."""
    check_device(key, "reshape_and_cache")
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(2) != 1 or value.stride(2) != 1 or key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError(
            "reshape_and_cache: the head dimension of keys, values and caches must be contiguous"
        )
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *key_cache.stride()[:3],
        *value_cache.stride()[:3],
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=key_cache.shape[1],
    )
