"""A draft model: a smaller model with the target's vocabulary proposes k tokens one at a time.

Its paged KV cache mirrors the target's block for block (same block ids, same tables), so preemption and freeing
need no bookkeeping of their own. It computes only for requests that propose: first the tokens it has not seen
(request.num_draft_computed on; a whole prompt after admission, usually just the target's newest token), then
its proposals one at a time. Proposals the target accepts keep the KV the draft wrote for them. When speculation
backs off the draft costs nothing, and catches up when it resumes.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer

from executor.kv.cache_manager import KVCacheManager
from executor.model_runner import Chunk, ModelRunner
from executor.models.llama import DecoderLM
from executor.models.loader import build_model, decoder_spec
from executor.models.model_files import load_weights, read_config, resolve_model
from executor.request import Request
from executor.sampling.sampler import draw, sampling_probs
from kvkernels.backend import Kernels


def load_draft_model(
    path: str,
    target_tokenizer,
    target_vocab_size: int,
    max_model_len: int,
    dtype: torch.dtype,
    device,
    kernels: Kernels,
) -> DecoderLM:
    """The draft's weights, after checking it can serve as a draft at all: same vocabulary, long enough."""
    if not Path(path).expanduser().exists():
        raise ValueError(f"speculative_model: {path!r} is neither 'ngram' nor an existing model path")
    try:
        model_path = resolve_model(path)
        spec = decoder_spec(read_config(model_path))
        tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    except ValueError as error:
        raise ValueError(f"speculative_model: {error}") from error
    if spec.vocab_size != target_vocab_size or tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(
            f"speculative_model: the draft's vocabulary ({spec.vocab_size} logits, {len(tokenizer)} tokens) "
            f"differs from the target's ({target_vocab_size} logits, {len(target_tokenizer)} tokens); "
            "a draft must share the target's tokenizer"
        )
    limit = min(spec.max_position, spec.sliding_window or spec.max_position)
    if limit < max_model_len:
        raise ValueError(
            f"speculative_model: the draft's context length {limit} is shorter than max_model_len {max_model_len}"
        )
    return build_model(spec, load_weights(model_path), dtype, device, kernels)


class DraftProposer:
    def __init__(self, model: DecoderLM, num_blocks: int, block_size: int, device, dtype) -> None:
        self.runner = ModelRunner(model, num_blocks, block_size, device, dtype)
        self.vocab_size = model.spec.vocab_size

    def propose(self, work: list[tuple[Request, int]], kv: KVCacheManager) -> None:
        """Set k proposals on each (request, k), whose blocks must cover k - 1 positions past its last token;
        k forward passes of the draft in all."""
        chunks = []
        for request, _ in work:
            start = request.num_draft_computed
            chunks.append(Chunk(kv.block_ids(request), start, request.token_ids[start:], 1))
            request.num_draft_computed = request.num_tokens
        logits = self.runner.run(chunks)
        tokens: list[list[int]] = [[] for _ in work]
        probs: list[list[torch.Tensor]] = [[] for _ in work]
        for j in range(max(k for _, k in work)):
            live = [i for i, (_, k) in enumerate(work) if k > j]
            if j:  # the previous proposals in, the next distributions out
                chunks = []
                for i in live:
                    request = work[i][0]
                    chunks.append(
                        Chunk(kv.block_ids(request), request.num_tokens + j - 1, [tokens[i][-1]], 1)
                    )
                logits = self.runner.run(chunks)
            drawn = self._draw(logits, [work[i][0] for i in live])
            for i, (token_id, q) in zip(live, drawn, strict=True):
                tokens[i].append(token_id)
                if q is not None:
                    probs[i].append(q)
        for i, (request, _) in enumerate(work):
            request.set_spec_tokens(tokens[i], torch.stack(probs[i]) if probs[i] else None)

    def _draw(self, logits: torch.Tensor, requests: list[Request]) -> list[tuple[int, torch.Tensor | None]]:
        """Greedy requests take the draft's argmax (q one-hot); the others sample from the draft's distribution
        under their own temperature and filters, which is then q for the rejection sampler."""
        token_ids = logits.argmax(dim=-1).tolist()
        out: list[tuple[int, torch.Tensor | None]] = [(t, None) for t in token_ids]
        random = [i for i, r in enumerate(requests) if not r.params.greedy]
        if random:
            index = torch.tensor(random, device=logits.device)
            q = sampling_probs(logits[index], [requests[i].params for i in random])
            drawn = draw(q, [requests[i].generator for i in random]).tolist()
            for row, i in enumerate(random):
                out[i] = (drawn[row], q[row])
        return out
