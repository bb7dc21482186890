"""Decode steps replayed from CUDA graphs.

A decode step of a small model is hundreds of small kernel launches, and on a fast GPU launching them from
Python takes longer than running them. So at start the forward pass is captured once per batch size in
capture_sizes() and each decode-only step replays the smallest graph that holds its batch: one launch.

A graph replays fixed shapes at fixed addresses, so its inputs live in static buffers that each step fills.
A batch is padded up to its graph's size; a padding token writes no KV (slot -1, which every
reshape_and_cache skips), attends to one position of block 0 (read only), and its output row is dropped.
Every kernel the graph holds must size its launch from shapes alone, never from values on the device: the
Triton backend does (graph_safe), the torch backend reads lengths back to the host and runs eagerly.

Mixed steps (prefill chunks, verification of proposals) run eagerly, as do batches larger than the largest
graph. `--enforce-eager` turns graphs off.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from executor.models.llama import AttentionBatch, DecoderLM

log = logging.getLogger("kvserve.engine")

MAX_CAPTURE_SIZE = 512  # vLLM's default largest graph


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then multiples of 8 (as vLLM), and max_num_seqs itself so that every decode batch has one."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [b for b in (1, 2, 4) if b <= top] + list(range(8, top + 1, 8))
    return sizes if sizes[-1] == top else [*sizes, top]


@dataclass(slots=True)
class DecodeRow:
    """One sequence's single new token: what a decode step needs of it."""

    token_id: int
    position: int
    block_ids: Sequence[int]  # a list, or a row of the KV cache manager's block table


class DecodeGraphs:
    """Static input buffers, and one captured forward pass per batch size over them.

    With capture=False the same padded forward runs eagerly over the same buffers each step: how the padding
    is tested where no CUDA device exists.
    """

    def __init__(
        self,
        model: DecoderLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        max_blocks_per_seq: int,
        sizes: list[int],
        device: torch.device,
        capture: bool,
    ) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.block_size = block_size
        self.sizes = sorted(sizes)
        self.capture_graphs = capture
        largest = self.sizes[-1]
        # token ids, positions, slots and context lengths in one buffer: one host-to-device copy a step. The
        # kernels want lengths as int32, so the graph itself converts that row.
        self.rows = torch.zeros((4, largest), dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)  # one token each
        self.block_table = torch.zeros((largest, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # each graph's hidden states, valid after its replay

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def fits(self, num_seqs: int, max_blocks: int) -> bool:
        return num_seqs <= self.max_batch and max_blocks <= self.block_table.shape[1]

    def _forward(self, size: int) -> torch.Tensor:
        ids, positions, slots, lens = self.rows[:, :size]
        batch = AttentionBatch(
            slot_mapping=slots,
            block_table=self.block_table[:size],
            seq_lens=lens.to(torch.int32),
            query_start_loc=self.query_start_loc[: size + 1],
        )
        return self.model(ids, positions, self.kv_caches, batch)

    def _fill(self, rows: list[DecodeRow], size: int) -> None:
        n, bs = len(rows), self.block_size
        width = max(len(r.block_ids) for r in rows)
        table = np.zeros((n, width), np.int32)
        for i, row in enumerate(rows):
            table[i, : len(row.block_ids)] = row.block_ids
        host = np.zeros((4, size), np.int64)
        host[2].fill(-1)  # padding writes no KV
        host[3].fill(1)  # and attends to one position
        host[0, :n] = np.fromiter((r.token_id for r in rows), np.int64, n)
        positions = np.fromiter((r.position for r in rows), np.int64, n)
        host[1, :n] = positions
        host[2, :n] = table[np.arange(n), positions // bs].astype(np.int64) * bs + positions % bs
        host[3, :n] = positions + 1
        self.rows[:, :size].copy_(torch.from_numpy(host))
        # columns past a row's own blocks may hold older ids: lengths keep the kernels from reading them
        self.block_table[:n, :width].copy_(torch.from_numpy(table))
        if size > n:
            self.block_table[n:size, 0] = 0

    @torch.inference_mode()
    def capture(self) -> None:
        """Every size, largest first so that the smaller graphs reuse its memory pool. Each size runs once
        eagerly first: Triton compiles there, not inside the capture."""
        if not self.capture_graphs:
            return
        started = time.perf_counter()
        before = torch.cuda.memory_reserved()
        self.rows[2].fill_(-1)  # capture-time runs write no KV
        self.rows[3].fill_(1)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        log.info(
            "CUDA graphs: %d decode batch sizes up to %d captured in %.1f s, %.0f MiB",
            len(self.sizes),
            self.max_batch,
            time.perf_counter() - started,
            (torch.cuda.memory_reserved() - before) / 2**20,
        )

    def run(self, rows: list[DecodeRow]) -> torch.Tensor:
        """Hidden states [len(rows), H] of one decode step, computed at the smallest size that holds it."""
        size = next(s for s in self.sizes if s >= len(rows))
        self._fill(rows, size)
        if self.capture_graphs:
            self.graphs[size].replay()
            hidden = self.outputs[size]
        else:
            hidden = self._forward(size)
        return hidden[: len(rows)]
