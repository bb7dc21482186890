"""Torch twins of the kernels: plain loops that define what is correct. Tests and bench/gpu/check.py hold each
kernel to its twin; the torch backend serves the rotary twin itself where no C++ kernel does (kvkernels/layer_ops.py)."""

from __future__ import annotations

import torch


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token t's K/V into slot slot_mapping[t] (block = slot // B, offset = slot % B); a negative slot
    marks a padding token, which writes nothing."""
    block_size = key_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        key_cache[slot // block_size, slot % block_size] = key[t]
        value_cache[slot // block_size, slot % block_size] = value[t]


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole paged context."""
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    out = torch.empty_like(query)
    for s in range(seq_lens.shape[0]):
        q_start, q_end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        seq_len, q_len = int(seq_lens[s]), q_end - q_start
        if q_len == 0:
            continue
        positions = torch.arange(seq_len)
        slots = block_table[s, positions // block_size].long() * block_size + positions % block_size
        k = key_cache.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = value_cache.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)
        q = query[q_start:q_end].float()  # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len)
        scores.masked_fill_(positions[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(query.dtype)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: normalise in fp32, round to x's dtype, then scale by the weight."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight.to(x.dtype) * normed


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual stream's add fused with the next layer's norm."""
    summed = (x.float() + residual.float()).to(x.dtype)
    return rms_norm(summed, weight, eps), summed


def rotary_embedding(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding of query [T,Hq,D] and key [T,Hkv,D], cos/sin [T,D] (each half repeated),
    computed in fp32 and rounded once."""

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf, half = x.float(), x.shape[-1] // 2
        rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
        return (xf * cos.float()[:, None, :] + rotated * sin.float()[:, None, :]).to(x.dtype)

    return rotate(query), rotate(key)


def int8_activations(x: torch.Tensor, planes: int = 1) -> torch.Tensor:
    """What quantized_gemm's activations stand for (kvkernels/csrc/int8_dot_kernel.h), in float64 [M, K]: each
    block of 32 of a row in steps of its largest magnitude / 127, rounded to nearest even (planes 1, int8); planes 2
    (int16) adds each block's rounding error, x - q * step in float32, in steps of step / 254. The integers are
    the kernel's bit for bit: the same float32 operations decide them."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    step = amax / 127.0
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inverse).clamp_(-128, 127)
    held = q.double() * step.double()
    if planes == 2:
        error = blocks - q * step
        residual = torch.round(error * (inverse * 254.0)).clamp_(-128, 127)
        held += residual.double() * (step / 254.0).double()
    return held.reshape(m, k)


def lora_add(x: torch.Tensor, out: torch.Tensor, groups) -> None:
    """out += each group's LoRA update of its rows of x. groups: (rows, a, parts), rows a slice or an index
    tensor, a [parts x rank, inputs] every targeted part's A stacked, parts (first output column, last + 1, B
    scaled and transposed [rank, columns], first row of its A): a shrink, then an expand per part."""
    for rows, a, parts in groups:
        shrunk = x[rows] @ a.T
        for start, end, bt, first in parts:
            update = shrunk[:, first : first + bt.shape[0]] @ bt
            if isinstance(rows, slice):
                out[rows, start:end] += update
            else:
                out[:, start:end].index_add_(0, rows, update)
