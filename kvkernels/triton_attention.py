"""Paged attention in Triton: prefill chunks, fresh prefills and decodes of one batch in a single launch.

One program takes a tile of query tokens of one sequence and one KV head, with all query heads that share
that KV head (GQA) stacked as rows: row m is query token m // GROUP, query head kv_head * GROUP + m % GROUP.
It walks the sequence's context in tiles of TILE_N positions, finding each position's physical block through
the block table, and keeps an online softmax in fp32. Query token i of a sequence with q_len new tokens sits
at position seq_len - q_len + i and sees positions up to its own (causal masking by absolute position).

Long decode-only batches leave most of the GPU idle with one program per (sequence, KV head), so there the
context is split across NUM_SPLITS programs, each writing a partial output with its log-sum-exp, and a second
kernel combines them. The grid never depends on values in device tensors, so a launch needs no host sync.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvkernels.triton_mode import check_device, interpreting

_LOG2E = 1.4426950408889634


@triton.jit
def _attention_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kn,
    stride_kb,
    stride_kh,
    stride_vn,
    stride_vb,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Sequence s owns the query tiles from query_start_loc[s] // BLOCK_Q + s on: enough for its own tokens
    # whatever their alignment, so the grid is sized from shapes alone. Find the last s starting at or before
    # this tile; tiles past a sequence's last token return at once.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first_tile <= tile, mid + 1, lo)
        hi = tl.where(first_tile <= tile, hi, mid)
    seq = lo - 1
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile_in_seq = tile - (q_start // BLOCK_Q + seq)
    if tile_in_seq * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    token = tile_in_seq * BLOCK_Q + offs_m // GROUP  # within the sequence's new tokens
    head = kv_head * GROUP + offs_m % GROUP
    row_valid = (offs_m < BLOCK_Q * GROUP) & (token < q_len)
    q_pos = context_len + token
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_valid = offs_d < HEAD_DIM
    q_rows = (q_start + token).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    # positions this tile's last query sees, then this program's share of them in tiles of TILE_N
    kv_end = context_len + tl.minimum((tile_in_seq + 1) * BLOCK_Q, q_len)
    num_tiles = tl.cdiv(kv_end, TILE_N)
    if NUM_SPLITS == 1:
        tile_lo = 0
        tile_hi = num_tiles
    else:
        per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        tile_lo = split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    for j in range(tile_lo, tile_hi):
        offs_n = j * TILE_N + tl.arange(0, TILE_N)
        kv_valid = offs_n < kv_end
        block = tl.load(table_row + offs_n // BLOCK_SIZE, mask=kv_valid, other=0).to(tl.int64)
        within = offs_n % BLOCK_SIZE
        k = tl.load(
            k_cache_ptr
            + block[None, :] * stride_kn
            + within[None, :] * stride_kb
            + kv_head * stride_kh
            + offs_d[:, None],
            mask=d_valid[:, None] & kv_valid[None, :],
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr
            + block[:, None] * stride_vn
            + within[:, None] * stride_vb
            + kv_head * stride_vh
            + offs_d[None, :],
            mask=kv_valid[:, None] & d_valid[None, :],
            other=0.0,
        )
        p_dtype = v.dtype  # probabilities meet V in V's precision, as on the tensor cores
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, k, input_precision=PRECISION) * scale_log2  # log2 units: exp2 below
        visible = row_valid[:, None] & (offs_n[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet stays at zero
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(p_dtype).to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    result = acc / tl.where(seen, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & d_valid[None, :],
        )
    else:
        # partials are contiguous [T, Hq, NUM_SPLITS, HEAD_DIM] and [T, Hq, NUM_SPLITS]
        part_row = (q_rows * (GROUP * tl.num_programs(1)) + head) * NUM_SPLITS + split
        tl.store(
            part_out_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :],
            result,
            mask=row_valid[:, None] & d_valid[None, :],
        )
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part_row, lse, mask=row_valid)


@triton.jit
def _combine_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    stride_ot,
    stride_oh,
    num_heads,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = token * num_heads + head
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_valid = offs_s < NUM_SPLITS
    d_valid = offs_d < HEAD_DIM
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + offs_s, mask=s_valid, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))  # splits that saw no position weigh nothing
    part = tl.load(
        part_out_ptr + (row * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    result = tl.sum(weight[:, None] * part, 0) / tl.sum(weight, 0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d,
        result.to(out_ptr.dtype.element_ty),
        mask=d_valid,
    )


@functools.cache
def _cuda_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_sms(device: torch.device) -> int | None:
    """The device's multiprocessors; None off a GPU (the interpreter), where the context is never split."""
    if device.type != "cuda":
        return None
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


def choose_num_splits(
    num_tokens: int, num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int | None
) -> int:
    """Split the context only for decode-like batches (one query per sequence) too few to fill the GPU."""
    if num_sms is None or num_tokens != num_seqs or max_context < 1024:
        return 1
    programs = num_seqs * num_kv_heads
    if programs >= 2 * num_sms:
        return 1
    splits = max(1, min(16, triton.cdiv(2 * num_sms, programs), max_context // 512))
    return 1 << (splits.bit_length() - 1)  # a power of two: few variants to compile


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """query [T,Hq,D], caches [N,B,Hkv,D] -> [T,Hq,D]; num_kv_splits None picks the split-KV form by shape."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    if num_heads % num_kv_heads:
        raise ValueError(
            f"paged_attention: {num_heads} query heads do not share {num_kv_heads} KV heads evenly"
        )
    if query.stride(2) != 1 or key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("paged_attention: the head dimension of query and caches must be contiguous")
    check_device(query, "paged_attention")
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    decode_like = num_tokens == num_seqs
    block_m = max(16 if decode_like else 64, triton.next_power_of_2(group))
    block_q = block_m // group
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
    tile_n = 64 if decode_like or head_dim_pad <= 64 else 32
    if num_kv_splits is None:
        max_context = block_table.shape[1] * block_size
        num_kv_splits = choose_num_splits(
            num_tokens, num_seqs, num_kv_heads, max_context, _num_sms(query.device)
        )
    if num_kv_splits > 1:
        part_out = torch.empty(
            (num_tokens, num_heads, num_kv_splits, head_dim), dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty(
            (num_tokens, num_heads, num_kv_splits), dtype=torch.float32, device=query.device
        )
    else:
        part_out = part_lse = out  # unused: the kernel writes `out` directly
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_kv_splits)
    # Triton 3.9's interpreter multiplies bf16 operands as their raw bits; bf16 -> fp32 is exact, so exact fp32
    # products give what the tensor cores give
    dot_in_fp32 = query.dtype == torch.bfloat16 and interpreting()
    _attention_kernel[grid](
        out,
        part_out,
        part_lse,
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        scale * _LOG2E,
        num_seqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        *key_cache.stride()[:3],
        *value_cache.stride()[:3],
        block_table.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=tile_n,
        NUM_SPLITS=num_kv_splits,
        PRECISION="ieee" if query.dtype == torch.float32 or dot_in_fp32 else "tf32",
        DOT_IN_FP32=dot_in_fp32,
    )
    if num_kv_splits > 1:
        _combine_splits_kernel[(num_tokens, num_heads)](
            out,
            part_out,
            part_lse,
            out.stride(0),
            out.stride(1),
            num_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS=num_kv_splits,
            SPLITS_PAD=triton.next_power_of_2(num_kv_splits),
        )
    return out
