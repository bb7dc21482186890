"""Turns a scheduled step into one flattened batch, runs the model over the paged cache, returns logits."""

from __future__ import annotations

import itertools
import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from executor.cuda_graphs import DecodeGraphs, DecodeRow, capture_sizes
from executor.kv.cache_manager import KVCacheManager
from executor.kv.layout import copy_blocks, kv_cache_shape, layer_caches
from executor.lora.adapter_files import LoRAAdapter
from executor.lora.lora_batch import LoRABatch
from executor.models.llama import AttentionBatch, DecoderLM
from executor.request import Request

# prompt logprobs: logits are computed (and scored) for this many prompt positions at a time, so that a step's
# logits never exceed max(this, its sampled rows) x vocabulary; every position at once would be a step's whole
# token budget (8,192 x 49k float32 rows: 1.6 GB, and again as log-softmax)
PROMPT_LOGITS_ROWS = 256


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros, its pages mapped now (one write per page), in 2 MiB pages where transparent huge
    pages are on.
    - Mapped at startup, not on first touch inside a step: first touches cost ~1.8 ms per MB in whichever step
      took fresh blocks, until the whole pool had been used once.
    - Decode attention reads 12 KiB runs scattered over the pool; 2 MiB pages spare it TLB misses and let the
      hardware prefetcher run past 4 KiB boundaries (5-10% faster)."""
    count = math.prod(shape)
    buffer = mmap.mmap(-1, max(1, count) * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    flat = torch.frombuffer(buffer, dtype=dtype)[:count]
    flat[:: max(1, mmap.PAGESIZE // dtype.itemsize)].zero_()  # one write per page maps it
    return flat.view(shape)


@dataclass(slots=True)
class StepLogits:
    requests: list[Request]  # the requests that get new tokens this step
    logits: torch.Tensor  # [sum(num_rows), V] float32, each request's rows after one another
    # per request: 1, plus the proposals it verifies this step (one row of logits each)
    num_rows: list[int]
    # prompt logprobs: (request, first prompt token scored, how many) per request that asked, and their rows'
    # hidden states [sum(how many), H] in that order (ModelRunner.logits, PROMPT_LOGITS_ROWS at a time): the
    # row of position p scores prompt token p + 1
    prompt_rows: list[tuple[Request, int, int]]
    prompt_hidden: torch.Tensor | None


@dataclass(slots=True)
class Chunk:
    """A run of one sequence's tokens to compute, from position start on, over its block table."""

    block_ids: Sequence[int]  # a list, or a row of the KV cache manager's block table
    start: int
    token_ids: list[int]
    num_logits: int  # logits wanted for the last num_logits tokens
    # prompt logprobs: logits also wanted for num_prompt_rows tokens from the chunk's first_prompt_row on
    first_prompt_row: int = 0
    num_prompt_rows: int = 0
    adapter: LoRAAdapter | None = None  # the LoRA adapter its tokens run under (None: the base model)


class ModelRunner:
    def __init__(
        self,
        model: DecoderLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.model = model
        self.block_size = block_size
        self.device = device
        # zeros: attention reads a partly filled block's unwritten slots (masked, but NaN * 0 is NaN); a block
        # used before holds finite values
        shape = kv_cache_shape(model.spec, num_blocks, block_size)
        if device.type == "cuda":
            self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        else:
            self.kv_cache = host_zeros(shape, dtype)
        self.kv_caches = layer_caches(self.kv_cache)
        self.decode_graphs: DecodeGraphs | None = None

    def enable_decode_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool = True) -> None:
        """Decode-only steps from now on run padded to a captured batch size (executor/cuda_graphs.py);
        capture=False runs that padded forward eagerly instead."""
        kernels = self.model.kernels
        if capture and not kernels.graph_safe:
            raise ValueError(
                f"CUDA graphs: the {kernels.name} attention backend reads lengths back to the host "
                "and cannot be captured; use --attention-backend triton or --enforce-eager"
            )
        self.decode_graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            self.block_size,
            -(-max_model_len // self.block_size),
            capture_sizes(max_num_seqs),
            self.device,
            capture,
        )
        self.decode_graphs.capture()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: each (source, destination) block's KV, every layer, K and V."""
        if copies:
            src, dst = (torch.tensor(ids, device=self.device) for ids in zip(*copies, strict=True))
            copy_blocks(self.kv_cache, src, dst)

    def execute(self, scheduled: list[tuple[Request, int]], kv: KVCacheManager) -> StepLogits:
        """One step of the scheduler's work; a request whose tokens all have KV after it gets logits at its last
        token and at each of the proposals scheduled for verification."""
        chunks, sampled, num_rows, prompt_rows = [], [], [], []
        if any(req.adapter is not None for req, _ in scheduled):
            # each adapter's rows together: its update is one slice of the batch, not a gather and a scatter
            scheduled = sorted(scheduled, key=lambda item: "" if item[0].lora is None else item[0].lora.name)
        for req, n in scheduled:
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            token_ids = req.token_ids[start:end]
            num_logits = 0
            if end >= req.num_tokens:
                token_ids += req.spec_token_ids[: end - req.num_tokens]
                num_logits = end - req.num_tokens + 1
                sampled.append(req)
                num_rows.append(num_logits)
            chunk = Chunk(kv.block_ids(req), start, token_ids, num_logits, adapter=req.adapter)
            if req.num_prompt_tokens_to_score:
                # positions first..last - 1 score prompt tokens first + 1..last; the last prompt position's
                # row predicts the first output token, so it is the sampled row, not a prompt row
                first = max(start, req.num_scored_prompt_tokens - 1)
                last = min(end, req.num_prompt_tokens - 1)
                if last > first:
                    chunk.first_prompt_row, chunk.num_prompt_rows = first - start, last - first
                    prompt_rows.append((req, first + 1, last - first))
            chunks.append(chunk)
        hidden = self.forward(chunks)
        num_sampled = sum(num_rows)
        prompt_hidden = hidden[num_sampled:] if prompt_rows else None
        return StepLogits(sampled, self.logits(hidden[:num_sampled]), num_rows, prompt_rows, prompt_hidden)

    def run(self, chunks: list[Chunk]) -> torch.Tensor:
        """One forward pass over chunks that want no prompt rows; logits [sum(num_logits), V] in chunk order."""
        return self.logits(self.forward(chunks))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, V] float32 logits of hidden states; none for none."""
        if hidden.shape[0] == 0:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk]) -> torch.Tensor:
        """One forward pass over every chunk; the hidden states of the rows that want logits
        [sum(num_logits), H] in chunk order, then those of the prompt rows [sum(num_prompt_rows), H], also in
        chunk order."""
        rows = self._decode_rows(chunks)
        if rows is not None:
            return self.decode_graphs.run(rows)
        batch, input_ids, positions, logit_rows = self._prepare(chunks)
        return self.model(input_ids, positions, self.kv_caches, batch)[logit_rows]

    def _decode_rows(self, chunks: list[Chunk]) -> list[DecodeRow] | None:
        """The step as decode rows when a decode graph can run it: one new token and its logits per chunk."""
        graphs = self.decode_graphs
        if (
            graphs is None
            or not chunks
            or not graphs.fits(len(chunks), max(len(c.block_ids) for c in chunks))
        ):
            return None
        if any(len(c.token_ids) != 1 or c.num_logits != 1 or c.num_prompt_rows or c.adapter for c in chunks):
            return None
        return [DecodeRow(c.token_ids[0], c.start, c.block_ids) for c in chunks]

    def _prepare(self, chunks: list[Chunk]):
        """The flattened batch, built with array operations over per-chunk numbers (no list per token):
        positions, slots and logit rows follow from each chunk's start, length and block table row."""
        bs, count = self.block_size, len(chunks)
        lengths = np.fromiter((len(c.token_ids) for c in chunks), np.int64, count)
        starts = np.fromiter((c.start for c in chunks), np.int64, count)
        num_logits = np.fromiter((c.num_logits for c in chunks), np.int64, count)
        ends = np.cumsum(lengths)
        query_start = np.zeros(count + 1, np.int64)
        query_start[1:] = ends
        if (lengths == 1).all():  # decodes
            ids = np.fromiter((c.token_ids[0] for c in chunks), np.int64, count)
            positions = starts
            seq_index = np.arange(count)
        else:
            ids = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), np.int64, ends[-1])
            seq_index = np.repeat(np.arange(count), lengths)
            positions = np.arange(ends[-1]) - np.repeat(query_start[:-1] - starts, lengths)
        width = max(len(c.block_ids) for c in chunks)
        table = np.zeros((count, width), np.int32)
        for i, chunk in enumerate(chunks):
            table[i, : len(chunk.block_ids)] = chunk.block_ids
        slots = table[seq_index, positions // bs].astype(np.int64) * bs + positions % bs
        # each chunk's last num_logits tokens
        wanted = np.repeat(ends - num_logits, num_logits) + _ramps(num_logits)
        if any(c.num_prompt_rows for c in chunks):  # then the prompt rows of the requests that asked
            num_prompt = np.fromiter((c.num_prompt_rows for c in chunks), np.int64, count)
            first = np.fromiter((c.first_prompt_row for c in chunks), np.int64, count) + query_start[:-1]
            wanted = np.concatenate([wanted, np.repeat(first, num_prompt) + _ramps(num_prompt)])
        dev = self.device
        batch = AttentionBatch(
            slot_mapping=torch.from_numpy(slots).to(dev),
            block_table=torch.from_numpy(table).to(dev),
            seq_lens=torch.from_numpy((starts + lengths).astype(np.int32)).to(dev),
            query_start_loc=torch.from_numpy(query_start.astype(np.int32)).to(dev),
            lora=LoRABatch.of_chunks(
                [c.adapter for c in chunks], query_start, dev, self.model.kernels.lora_add
            ),
        )
        input_ids = torch.from_numpy(ids).to(dev)
        rows = torch.from_numpy(wanted).to(dev)
        return batch, input_ids, torch.from_numpy(positions).to(dev), rows


def _ramps(counts: np.ndarray) -> np.ndarray:
    """0, 1, ..., counts[0] - 1, then 0, 1, ..., counts[1] - 1, ...: the offsets within each run."""
    total = int(counts.sum())
    offsets = np.zeros(len(counts), np.int64)
    np.cumsum(counts[:-1], out=offsets[1:])
    return np.arange(total) - np.repeat(offsets, counts)
