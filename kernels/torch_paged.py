"""Paged attention in batched torch ops: the CPU path, and the fallback where Triton is missing.

Decodes (one query each) share one batched SDPA call; each prefill chunk gets its own, since padding a
batch of chunks to the longest one would waste most of the work.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[S, M] block ids -> [S, Hkv, M*B, D] contiguous context."""
    s, m = block_table.shape
    ctx = cache[block_table.reshape(-1)].view(s, m * cache.shape[1], cache.shape[2], cache.shape[3])
    return ctx.transpose(1, 2)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    block_size = key_cache.shape[1]
    out = torch.empty_like(query)
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    lens = seq_lens.tolist()
    starts = query_start_loc.tolist()
    decode_rows = [s for s, n in enumerate(q_lens) if n == 1]
    if decode_rows:
        rows = torch.tensor(decode_rows, device=query.device)
        max_len = max(lens[s] for s in decode_rows)
        tables = block_table[rows, : -(-max_len // block_size)]
        k = _gather(key_cache, tables)
        v = _gather(value_cache, tables)
        token_rows = query_start_loc[rows]
        q = query[token_rows].unsqueeze(2)  # [Sd, Hq, 1, D]
        mask = torch.arange(k.shape[2], device=query.device)[None, :] < seq_lens[rows][:, None]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
        )
        out[token_rows] = o.squeeze(2)
    for s, q_len in enumerate(q_lens):
        if q_len <= 1:
            continue
        seq_len, start = lens[s], starts[s]
        tables = block_table[s : s + 1, : -(-seq_len // block_size)]
        k = _gather(key_cache, tables)[:, :, :seq_len]
        v = _gather(value_cache, tables)[:, :, :seq_len]
        q = query[start : start + q_len].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
        if q_len == seq_len:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start : start + q_len] = o[0].transpose(0, 1)
    return out
