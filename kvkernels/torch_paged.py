"""Paged attention in batched torch ops: the CPU path, and the fallback where Triton is missing.

On the CPU, attention is two C++ kernels (kvkernels/csrc) when they are built, both reading blocks in place: one
for decodes (a step of decodes alone is one call with no bookkeeping on the host, a query row per sequence) and
one for the chunks of two or more tokens, all of a step's in one call. Otherwise decodes (one query each) are
sorted by context length and attended in a few groups, one SDPA call each, so padding to a group's longest
context wastes little. Each prefill chunk gets its own call. Blocks are gathered
with index_select on a [num_blocks, block_bytes] view: several times faster than advanced indexing on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvkernels.cpu_extension import cpu_kernels

# a decode group grows while its padded size stays within this factor of the tokens it really holds
_MAX_PADDING = 1.25


def _uses_cpu_kernels(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32


def build(device: torch.device, dtype: torch.dtype) -> None:
    """Build the C++ CPU kernels now if this device and dtype will call them: their first build takes about a
    minute, which belongs to the executor's start, not to the first request."""
    if _uses_cpu_kernels(device, dtype):
        cpu_kernels()


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    ops = cpu_kernels() if _uses_cpu_kernels(key.device, key.dtype) else None
    if ops is not None and key.stride(-1) == 1 and value.stride(-1) == 1:
        ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        return
    if slot_mapping.numel() and slot_mapping.min() < 0:  # padding tokens (slot -1) write nothing
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[S, M] block ids -> [S, Hkv, M*B, D] context (a strided view of one contiguous copy)."""
    num_blocks, block_size, heads, dim = cache.shape
    s, m = block_table.shape
    rows = torch.index_select(cache.view(num_blocks, -1), 0, block_table.reshape(-1))
    return rows.view(s, m * block_size, heads, dim).transpose(1, 2)


def decode_groups(lengths: list[int], rows: list[int]) -> list[list[int]]:
    """Rows sorted longest first, cut into groups whose padding stays small."""
    ordered = sorted(rows, key=lambda s: -lengths[s])
    groups: list[list[int]] = []
    total = 0
    for s in ordered:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= _MAX_PADDING * (total + lengths[s]):
            groups[-1].append(s)
            total += lengths[s]
        else:
            groups.append([s])
            total = lengths[s]
    return groups


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    extension = cpu_kernels() if _uses_cpu_kernels(query.device, query.dtype) else None
    if extension is not None and query.shape[0] == block_table.shape[0]:
        # as many query tokens as sequences, and each has at least one: a step of decodes only
        return extension.decode_attention(query, key_cache, value_cache, block_table, seq_lens, scale)
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    q_lens = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    decode_rows = [s for s, n in enumerate(q_lens) if n == 1]
    if extension is not None:
        if decode_rows:
            rows = torch.tensor(decode_rows)
            token_rows = query_start_loc[rows].long()
            out[token_rows] = extension.decode_attention(
                query[token_rows], key_cache, value_cache, block_table[rows], seq_lens[rows], scale
            )
        extension.prefill_attention_(
            out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale
        )
        return out
    block_size = key_cache.shape[1]
    lens = seq_lens.tolist()
    for group in decode_groups(lens, decode_rows):
        rows = torch.tensor(group, device=query.device)
        tables = block_table[rows, : -(-lens[group[0]] // block_size)]
        k, v = _gather(key_cache, tables), _gather(value_cache, tables)
        token_rows = query_start_loc[rows].long()
        q = query[token_rows].unsqueeze(2)  # [G, Hq, 1, D]
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
