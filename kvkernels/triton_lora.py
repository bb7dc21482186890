"""LoRA's update of a step's rows on CUDA, every adapter's group of rows in two launches, as Punica's SGMV does: a
shrink of each group's rows by its stacked A into a float32 buffer, then an expand of that into each targeted
part's output columns. Twin: kvkernels.torch_twins.lora_add, whose docstring gives the groups' form.

Each adapter's matrices are tensors of their own, so the kernels reach them through tables of addresses built on
the host (these steps never run under CUDA graphs: executor/model_runner.py keeps adapter steps out of them). A
group's rows are a slice of x, or a stretch of one index holding every gathered group's rows: a slice is never
expanded on the host, which for a long prefill would cost more than its launches.

The shrink splits K (the projection's inputs) into fixed chunks, each program writing its partial sum: a decode
step has a few rows per adapter, and without the split a handful of programs would walk all of K alone. The
expand adds the partials in order, so a row's bits depend on neither the batch around it nor timing, which
atomic adds would not give. Every group's rows are its own and parts' columns do not overlap, so each output
element is written by one program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvkernels.triton_mode import check_device, interpreting

# the shrink's tile: rows, rows of A (parts x rank), inputs per step of its loop; and inputs per split
SHRINK_M, SHRINK_N, SHRINK_K, SPLIT_K = 16, 16, 64, 512
# the expand's tile: rows, output columns; rank per step of its loop at most
EXPAND_M, EXPAND_N, EXPAND_R = 16, 64, 64
# the tables' rows: a group's (its first row in the shrunk buffer, rows, address of A, rows of A, first row of x
# where they are a slice, their place in the index where gathered or -1); a pair's (group, first output column,
# columns, address of bt, rank, first row of its A)
GROUP_FIELDS = tl.constexpr(6)
PAIR_FIELDS = tl.constexpr(6)


@triton.jit
def _rows_of_x(groups_ptr, index_ptr, group, offs_m, m_valid):
    """The rows of x that a group's rows offs_m are: from its slice, or from the index where they are gathered."""
    first_x_row = tl.load(groups_ptr + group * GROUP_FIELDS + 4)
    index_at = tl.load(groups_ptr + group * GROUP_FIELDS + 5)
    is_gathered = index_at + tl.zeros_like(offs_m) >= 0  # a block of it: a mask must be one
    gathered = tl.load(index_ptr + index_at + offs_m, mask=m_valid & is_gathered, other=0)
    return tl.where(is_gathered, gathered, first_x_row + offs_m)


@triton.jit
def _shrink_kernel(
    x_ptr,
    shrunk_ptr,
    index_ptr,
    groups_ptr,
    K,
    stride_x,
    stride_split,
    stride_s,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    group = tl.program_id(0)
    row_block = tl.program_id(1)
    n_block = tl.program_id(2) // tl.cdiv(K, K_PER_SPLIT)
    split = tl.program_id(2) % tl.cdiv(K, K_PER_SPLIT)
    first_row = tl.load(groups_ptr + group * GROUP_FIELDS)
    num_rows = tl.load(groups_ptr + group * GROUP_FIELDS + 1)
    a_rows = tl.load(groups_ptr + group * GROUP_FIELDS + 3)
    if row_block * BLOCK_M >= num_rows or n_block * BLOCK_N >= a_rows:
        return
    a_ptr = tl.load(groups_ptr + group * GROUP_FIELDS + 2).to(tl.pointer_type(x_ptr.dtype.element_ty))
    offs_m = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_valid = offs_m < num_rows
    rows = _rows_of_x(groups_ptr, index_ptr, group, offs_m, m_valid)
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < a_rows
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(split * K_PER_SPLIT, tl.minimum((split + 1) * K_PER_SPLIT, K), BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + offs_k[None, :],
            mask=m_valid[:, None] & k_valid[None, :],
            other=0.0,
        )
        a = tl.load(
            a_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None],
            mask=k_valid[:, None] & n_valid[None, :],
            other=0.0,
        )
        if DOT_IN_FP32:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        acc += tl.dot(x, a, input_precision=PRECISION)
    s_rows = (first_row + offs_m).to(tl.int64)
    tl.store(
        shrunk_ptr + split * stride_split + s_rows[:, None] * stride_s + offs_n[None, :],
        acc,
        mask=m_valid[:, None] & n_valid[None, :],
    )


@triton.jit
def _expand_kernel(
    out_ptr,
    shrunk_ptr,
    index_ptr,
    groups_ptr,
    pairs_ptr,
    stride_o,
    stride_split,
    stride_s,
    NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    pair = tl.program_id(0)
    row_block = tl.program_id(1)
    col_block = tl.program_id(2)
    group = tl.load(pairs_ptr + pair * PAIR_FIELDS)
    first_col = tl.load(pairs_ptr + pair * PAIR_FIELDS + 1)
    num_cols = tl.load(pairs_ptr + pair * PAIR_FIELDS + 2)
    rank = tl.load(pairs_ptr + pair * PAIR_FIELDS + 4)
    first_a_row = tl.load(pairs_ptr + pair * PAIR_FIELDS + 5)
    first_row = tl.load(groups_ptr + group * GROUP_FIELDS)
    num_rows = tl.load(groups_ptr + group * GROUP_FIELDS + 1)
    if row_block * BLOCK_M >= num_rows or col_block * BLOCK_N >= num_cols:
        return
    bt_ptr = tl.load(pairs_ptr + pair * PAIR_FIELDS + 3).to(tl.pointer_type(out_ptr.dtype.element_ty))
    offs_m = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_valid = offs_m < num_rows
    rows = _rows_of_x(groups_ptr, index_ptr, group, offs_m, m_valid)
    s_rows = (first_row + offs_m).to(tl.int64)
    offs_n = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < num_cols
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for r in range(0, rank, BLOCK_R):
        offs_r = r + tl.arange(0, BLOCK_R)
        r_valid = offs_r < rank
        s_mask = m_valid[:, None] & r_valid[None, :]
        s_ptrs = shrunk_ptr + s_rows[:, None] * stride_s + first_a_row + offs_r[None, :]
        s = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
        for split in range(NUM_SPLITS):
            s += tl.load(s_ptrs + split * stride_split, mask=s_mask, other=0.0)
        bt = tl.load(
            bt_ptr + offs_r[:, None].to(tl.int64) * num_cols + offs_n[None, :],
            mask=r_valid[:, None] & n_valid[None, :],
            other=0.0,
        )
        # the shrunk rows meet B in B's precision, as the twin's matmul rounds them (and the tensor cores take them)
        s = s.to(bt.dtype)
        if DOT_IN_FP32:
            s = s.to(tl.float32)
            bt = bt.to(tl.float32)
        acc += tl.dot(s, bt, input_precision=PRECISION)
    o_ptrs = out_ptr + rows[:, None] * stride_o + first_col + offs_n[None, :]
    o_mask = m_valid[:, None] & n_valid[None, :]
    current = tl.load(o_ptrs, mask=o_mask, other=0.0)
    tl.store(o_ptrs, (current.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=o_mask)


def _row_count(rows) -> int:
    return rows.stop - rows.start if isinstance(rows, slice) else rows.numel()


def _tables(groups, device: torch.device):
    """The groups' table and the (group, part) pairs' table on the device, in one copy from the host; the index
    of every gathered group's rows; and the rows of all groups."""
    group_table, pair_table, gathered = [], [], []
    first = indexed = 0
    for g, (rows, a, parts) in enumerate(groups):
        count = _row_count(rows)
        if isinstance(rows, slice):
            group_table += [first, count, a.data_ptr(), a.shape[0], rows.start, -1]
        else:
            group_table += [first, count, a.data_ptr(), a.shape[0], 0, indexed]
            gathered.append(rows.to(device=device, dtype=torch.int64))
            indexed += count
        for start, end, bt, a_row in parts:
            pair_table += [g, start, end - start, bt.data_ptr(), bt.shape[0], a_row]
        first += count
    # from pinned memory, without waiting: a copy from pageable memory would wait for the device to finish all it
    # was given, at every projection of every layer (the pinned block is not reused before the copy has run)
    on_cuda = device.type == "cuda"
    host = torch.tensor(group_table + pair_table, dtype=torch.int64, pin_memory=on_cuda)
    packed = host.to(device, non_blocking=on_cuda)
    index = torch.cat(gathered) if gathered else packed  # without gathered rows, never read
    return packed[: len(group_table)], packed[len(group_table) :], index, first


def _check(x: torch.Tensor, out: torch.Tensor, groups) -> None:
    if x.dim() != 2 or out.dim() != 2 or x.shape[0] != out.shape[0]:
        raise ValueError(f"lora_add: x {tuple(x.shape)} and out {tuple(out.shape)} must be [rows, features]")
    if out.stride(-1) != 1:
        raise ValueError("lora_add: out's columns must be contiguous")
    for rows, a, parts in groups:
        if a.dtype != x.dtype or out.dtype != x.dtype or any(bt.dtype != x.dtype for _, _, bt, _ in parts):
            raise ValueError(f"lora_add: x, out and the adapter's matrices must share x's dtype, {x.dtype}")
        # the kernels address A and B by their first element and their widths
        if a.dim() != 2 or a.shape[1] != x.shape[1] or not a.is_contiguous():
            raise ValueError(f"lora_add: A {tuple(a.shape)} must be contiguous [parts x rank, {x.shape[1]}]")
        if isinstance(rows, slice) and not 0 <= rows.start <= rows.stop <= x.shape[0]:
            raise ValueError(f"lora_add: rows {rows.start}:{rows.stop} outside x's {x.shape[0]}")
        for start, end, bt, first in parts:
            if not 0 <= start <= end <= out.shape[1] or bt.shape[1] != end - start or not bt.is_contiguous():
                raise ValueError(
                    f"lora_add: part's columns {start}:{end} do not fit out, or B {tuple(bt.shape)} is not "
                    "contiguous [rank, columns]"
                )
            if not 0 <= first <= first + bt.shape[0] <= a.shape[0]:
                raise ValueError(f"lora_add: part's rows of A {first}:{first + bt.shape[0]} outside A's")


def lora_add(x: torch.Tensor, out: torch.Tensor, groups) -> None:
    """out += each group's LoRA update of its rows of x: one shrink launch and one expand launch for all."""
    check_device(x, "lora_add")
    _check(x, out, groups)
    # groups of no rows, and parts of no columns, add nothing
    groups = [(rows, a, [p for p in parts if p[1] > p[0]]) for rows, a, parts in groups if _row_count(rows)]
    groups = [group for group in groups if group[2]]
    if not groups:
        return
    if x.stride(-1) != 1:
        x = x.contiguous()
    group_table, pair_table, index, num_rows = _tables(groups, x.device)
    max_rows = max(_row_count(rows) for rows, _, _ in groups)
    max_a_rows = max(a.shape[0] for _, a, _ in groups)
    parts = [part for _, _, group_parts in groups for part in group_parts]
    num_splits = triton.cdiv(x.shape[1], SPLIT_K)
    shrunk = torch.empty((num_splits, num_rows, max_a_rows), dtype=torch.float32, device=x.device)
    # Triton 3.9's interpreter multiplies bf16 operands as their raw bits; bf16 -> fp32 is exact, so exact fp32
    # products give what the tensor cores give
    dot_in_fp32 = x.dtype == torch.bfloat16 and interpreting()
    precision = "ieee" if x.dtype == torch.float32 or dot_in_fp32 else "tf32"
    _shrink_kernel[
        (len(groups), triton.cdiv(max_rows, SHRINK_M), triton.cdiv(max_a_rows, SHRINK_N) * num_splits)
    ](
        x,
        shrunk,
        index,
        group_table,
        x.shape[1],
        x.stride(0),
        shrunk.stride(0),
        shrunk.stride(1),
        BLOCK_M=SHRINK_M,
        BLOCK_N=SHRINK_N,
        BLOCK_K=SHRINK_K,
        K_PER_SPLIT=SPLIT_K,
        PRECISION=precision,
        DOT_IN_FP32=dot_in_fp32,
    )
    max_rank = max(bt.shape[0] for _, _, bt, _ in parts)
    max_cols = max(end - start for start, end, _, _ in parts)
    _expand_kernel[(len(parts), triton.cdiv(max_rows, EXPAND_M), triton.cdiv(max_cols, EXPAND_N))](
        out,
        shrunk,
        index,
        group_table,
        pair_table,
        out.stride(0),
        shrunk.stride(0),
        shrunk.stride(1),
        NUM_SPLITS=num_splits,
        BLOCK_M=EXPAND_M,
        BLOCK_N=EXPAND_N,
        # tl.dot needs K >= 16
        BLOCK_R=min(EXPAND_R, max(16, triton.next_power_of_2(max_rank))),
        PRECISION=precision,
        DOT_IN_FP32=dot_in_fp32,
    )
