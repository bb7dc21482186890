"""Turns a scheduled step into one flattened batch, runs the model over the paged cache, returns logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor.cuda_graphs import DecodeGraphs, DecodeRow, capture_sizes
from executor.kv_cache_manager import KVCacheManager
from executor.models import AttentionBatch, DecoderLM
from executor.request import Request
from kernels.backend import TORCH, AttentionBackend


@dataclass(slots=True)
class StepLogits:
    requests: list[Request]  # the requests that get new tokens this step
    logits: torch.Tensor  # [sum(num_rows), V] float32, each request's rows after one another
    # per request: 1, plus the proposals it verifies this step (one row of logits each)
    num_rows: list[int]


@dataclass(slots=True)
class Chunk:
    """A run of one sequence's tokens to compute, from position start on, over its block table."""

    block_ids: list[int]
    start: int
    token_ids: list[int]
    num_logits: int  # logits wanted for the last num_logits tokens


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
        self.decode_graphs: DecodeGraphs | None = None

    def enable_decode_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool = True) -> None:
        """Decode-only steps from now on run padded to a captured batch size (executor/cuda_graphs.py);
        capture=False runs that padded forward eagerly instead."""
        if capture and not self.attention.graph_safe:
            raise ValueError(
                f"CUDA graphs: the {self.attention.name} attention backend reads lengths back to the host "
                "and cannot be captured; use --attention-backend triton or --enforce-eager"
            )
        self.decode_graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            self.attention,
            self.block_size,
            -(-max_model_len // self.block_size),
            capture_sizes(max_num_seqs),
            self.device,
            capture,
        )
        self.decode_graphs.capture()

    @staticmethod
    def bytes_per_block(model: DecoderLM, block_size: int, dtype: torch.dtype) -> int:
        spec = model.spec
        return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * dtype.itemsize

    def zero_blocks(self, block_ids: list[int]) -> None:
        if block_ids and self.device.type != "cuda":
            layers, kv, num_blocks = self.kv_cache.shape[:3]
            rows = self.kv_cache.view(layers * kv, num_blocks, -1)
            rows.index_fill_(1, torch.tensor(block_ids), 0)

    def execute(self, scheduled: list[tuple[Request, int]], kv: KVCacheManager) -> StepLogits:
        """One step of the scheduler's work; a request whose tokens all have KV after it gets logits at its last
        token and at each of the proposals scheduled for verification."""
        chunks, sampled, num_rows = [], [], []
        for req, n in scheduled:
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            token_ids = req.token_ids[start:end]
            num_logits = 0
            if end >= req.num_tokens:
                token_ids += req.spec_token_ids[: end - req.num_tokens]
                num_logits = end - req.num_tokens + 1
                sampled.append(req)
                num_rows.append(num_logits)
            chunks.append(Chunk(kv.block_ids(req), start, token_ids, num_logits))
        return StepLogits(sampled, self.run(chunks), num_rows)

    @torch.inference_mode()
    def run(self, chunks: list[Chunk]) -> torch.Tensor:
        """One forward pass over every chunk; logits [sum(num_logits), V] in chunk order."""
        rows = self._decode_rows(chunks)
        if rows is not None:
            return self.model.compute_logits(self.decode_graphs.run(rows))
        batch, input_ids, positions, logit_rows = self._prepare(chunks)
        hidden = self.model(input_ids, positions, self.kv_caches, batch)
        if logit_rows.numel() == 0:
            return hidden.new_empty((0, 0))
        return self.model.compute_logits(hidden[logit_rows])

    def _decode_rows(self, chunks: list[Chunk]) -> list[DecodeRow] | None:
        """The step as decode rows when a decode graph can run it: one new token and its logits per chunk."""
        graphs = self.decode_graphs
        if (
            graphs is None
            or not chunks
            or not graphs.fits(len(chunks), max(len(c.block_ids) for c in chunks))
        ):
            return None
        if any(len(c.token_ids) != 1 or c.num_logits != 1 for c in chunks):
            return None
        return [DecodeRow(c.token_ids[0], c.start, c.block_ids) for c in chunks]

    def _prepare(self, chunks: list[Chunk]):
        bs = self.block_size
        ids: list[int] = []
        seq_index: list[int] = []
        pos: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        logit_rows: list[int] = []
        for s, chunk in enumerate(chunks):
            n = len(chunk.token_ids)
            ids.extend(chunk.token_ids)
            pos.extend(range(chunk.start, chunk.start + n))
            seq_index.extend([s] * n)
            query_start.append(query_start[-1] + n)
            seq_lens.append(chunk.start + n)
            logit_rows.extend(range(query_start[-1] - chunk.num_logits, query_start[-1]))
        width = max(len(c.block_ids) for c in chunks)
        table = torch.tensor(
            [c.block_ids + [0] * (width - len(c.block_ids)) for c in chunks], dtype=torch.int32
        )
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
        rows = torch.tensor(logit_rows, dtype=torch.int64, device=dev)
        return batch, input_ids, positions.to(dev), rows
