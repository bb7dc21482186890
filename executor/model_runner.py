"""Turns a scheduled step into one flattened batch, runs the model over the paged cache, returns logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor.kv_cache_manager import KVCacheManager
from executor.models import AttentionBatch, DecoderLM
from executor.request import Request
from kernels.backend import TORCH, AttentionBackend


@dataclass(slots=True)
class StepLogits:
    requests: list[Request]  # the requests that get a new token this step
    logits: torch.Tensor  # [len(requests), V] float32


class ModelRunner:
    def __init__(
        self,
        model: DecoderLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        attention: AttentionBackend = TORCH,
    ):
        spec = model.spec
        self.model = model
        self.attention = attention
        self.block_size = block_size
        self.device = device
        # every layer's K and V in one tensor, so zeroing fresh blocks is one op
        shape = (spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        # CPU: empty, since zeroing gigabytes up front costs seconds; blocks are zeroed on first use instead,
        # as attention reads a partly filled block's unwritten slots (masked, but NaN * 0 is NaN)
        alloc = torch.zeros if device.type == "cuda" else torch.empty
        self.kv_cache = alloc(shape, dtype=dtype, device=device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(spec.num_layers)]

    @staticmethod
    def bytes_per_block(model: DecoderLM, block_size: int, dtype: torch.dtype) -> int:
        spec = model.spec
        return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * dtype.itemsize

    def zero_blocks(self, block_ids: list[int]) -> None:
        if block_ids and self.device.type != "cuda":
            layers, kv, num_blocks = self.kv_cache.shape[:3]
            rows = self.kv_cache.view(layers * kv, num_blocks, -1)
            rows.index_fill_(1, torch.tensor(block_ids), 0)

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Request, int]], kv: KVCacheManager) -> StepLogits:
        batch, input_ids, positions, sample_rows, sampled = self._prepare(scheduled, kv)
        hidden = self.model(input_ids, positions, self.kv_caches, batch)
        logits = self.model.compute_logits(hidden[sample_rows]) if sampled else hidden.new_empty((0, 0))
        return StepLogits(sampled, logits)

    def _prepare(self, scheduled: list[tuple[Request, int]], kv: KVCacheManager):
        bs = self.block_size
        ids: list[int] = []
        seq_index: list[int] = []
        pos: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sampled: list[Request] = []
        for s, (req, n) in enumerate(scheduled):
            start = req.num_computed_tokens
            ids.extend(req.token_ids[start : start + n])
            pos.extend(range(start, start + n))
            seq_index.extend([s] * n)
            query_start.append(query_start[-1] + n)
            seq_lens.append(start + n)
            tables.append(kv.block_ids(req))
            if start + n == req.num_tokens:
                sample_rows.append(query_start[-1] - 1)
                sampled.append(req)
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        positions = torch.tensor(pos, dtype=torch.int64)
        seq_idx = torch.tensor(seq_index, dtype=torch.int64)
        slots = table[seq_idx, positions // bs].long() * bs + positions % bs
        dev = self.device
        batch = AttentionBatch(
            slot_mapping=slots.to(dev),
            block_table=table.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            attention=self.attention,
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        rows = torch.tensor(sample_rows, dtype=torch.int64, device=dev)
        return batch, input_ids, positions.to(dev), rows, sampled
