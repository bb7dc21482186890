"""RMSNorm (optionally fused with the residual add) and rotary embedding in Triton, one program per token.

Both are memory-bound elementwise work between matmuls; on a GPU each saves round trips through memory that
the torch forms make (the add, the fp32 upcast, the rotate-half copy). Twins: kvkernels.torch_twins.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvkernels.triton_mode import check_device


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    summed_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    eps,
    stride_x,
    stride_r,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(summed_ptr + row * HIDDEN + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / HIDDEN + eps)
    # as HF: normalise, round to x's dtype, then scale, rounding again. Arithmetic stays in fp32 (rounding the
    # product of two rounded values is what a bf16 multiply does), also as Triton's interpreter has no bf16 math
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * HIDDEN + offs, (weight * normed).to(x.dtype), mask=mask)


def _launch_rms_norm(x, residual, weight, eps):
    check_device(x, "rms_norm")
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    if rows.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("rms_norm: the hidden dimension must be contiguous")
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty_like(out) if residual is not None else out
    res_rows = residual.reshape(-1, hidden) if residual is not None else rows
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            out,
            summed,
            rows,
            res_rows,
            weight,
            eps,
            rows.stride(0),
            res_rows.stride(0),
            HIDDEN=hidden,
            BLOCK=triton.next_power_of_2(hidden),
            HAS_RESIDUAL=residual is not None,
        )
    return out.view(x.shape), summed.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch_rms_norm(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass over memory."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} must match x")
    return _launch_rms_norm(x, residual, weight, eps)


@triton.jit
def _rotary_kernel(
    q_out_ptr,
    k_out_ptr,
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ct,
    stride_st,
    Q_HEADS: tl.constexpr,
    K_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HALF_PAD)
    d_valid = offs_d < HALF
    # cos/sin repeat their first half in the second: the first half serves both
    cos = tl.load(cos_ptr + token * stride_ct + offs_d, mask=d_valid, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + token * stride_st + offs_d, mask=d_valid, other=0.0).to(tl.float32)[None, :]
    for which in tl.static_range(2):  # query heads, then key heads
        if which == 0:
            src, dst, stride_t, stride_h, heads = q_ptr, q_out_ptr, stride_qt, stride_qh, Q_HEADS
        else:
            src, dst, stride_t, stride_h, heads = k_ptr, k_out_ptr, stride_kt, stride_kh, K_HEADS
        mask = (offs_h[:, None] < heads) & d_valid[None, :]
        first = src + token * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
        x1 = tl.load(first, mask=mask, other=0.0)
        x2 = tl.load(first + HALF, mask=mask, other=0.0)
        out_first = dst + token * heads * HALF * 2 + offs_h[:, None] * HALF * 2 + offs_d[None, :]
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(out_first, (x1f * cos - x2f * sin).to(x1.dtype), mask=mask)
        tl.store(out_first + HALF, (x2f * cos + x1f * sin).to(x1.dtype), mask=mask)


def rotary_embedding(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T,Hq,D], key [T,Hkv,D], cos/sin [T,D] -> rotated copies (rotate-half convention)."""
    check_device(query, "rotary_embedding")
    num_tokens, q_heads, head_dim = query.shape
    k_heads = key.shape[1]
    if head_dim % 2 or key.shape[2] != head_dim or cos.shape != (num_tokens, head_dim):
        raise ValueError(
            f"rotary_embedding: query {tuple(query.shape)}, key {tuple(key.shape)} and cos {tuple(cos.shape)} "
            "need one even head dim and cos/sin [T, D]"
        )
    if query.stride(2) != 1 or key.stride(2) != 1 or cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError("rotary_embedding: the head dimension must be contiguous")
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            q_out,
            k_out,
            query,
            key,
            cos,
            sin,
            query.stride(0),
            query.stride(1),
            key.stride(0),
            key.stride(1),
            cos.stride(0),
            sin.stride(0),
            Q_HEADS=q_heads,
            K_HEADS=k_heads,
            HEADS_PAD=triton.next_power_of_2(max(q_heads, k_heads)),
            HALF=head_dim // 2,
            HALF_PAD=triton.next_power_of_2(head_dim // 2),
        )
    return q_out, k_out
