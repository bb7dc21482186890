"""The engine: requests in, one scheduled step at a time, new tokens out."""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer

from executor.block_pool import BlockPool
from executor.kv_cache_manager import KVCacheManager
from executor.kv_sizing import kv_cache_bytes, pick_device_and_dtype
from executor.model_files import load_weights, read_config, resolve_model
from executor.model_runner import ModelRunner
from executor.models import build_model, decoder_spec
from executor.request import Request, RequestStatus
from executor.sampler import Sampler, SamplingRow, TokenLogprobs
from executor.scheduler import Scheduler
from executor.spec_decode import NgramProposer, SpecBackoff, verify
from executor.spec_decode.draft import DraftProposer, load_draft_model
from executor.structured_output import Grammars, step_bitmask
from kernels.backend import choose_attention_backend
from shared.engine_config import EngineConfig
from shared.sampling_params import SamplingParams

log = logging.getLogger("kvserve.engine")

NGRAM = "ngram"  # --speculative-model ngram: prompt lookup instead of a draft model


@dataclass(slots=True)
class StepOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None]
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    num_cached_tokens: int
    num_accepted_tokens: int = 0  # proposals of this request the target has accepted so far
    error: str | None = None  # refused after it was queued (its grammar failed to compile): a 400's message


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.device, self.dtype = pick_device_and_dtype(config.device, config.dtype)
        config = dataclasses.replace(
            config, max_num_batched_tokens=config.batched_tokens_for(self.device.type)
        )
        self.config = config
        self.attention = choose_attention_backend(config.attention_backend, self.device)
        self.model_path = resolve_model(config.model)
        hf_config = read_config(self.model_path)
        spec = decoder_spec(hf_config)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
        self.eos_token_ids = _eos_token_ids(hf_config, self.model_path, self.tokenizer)
        self.max_model_len = _max_model_len(config.max_model_len, spec)
        torch.manual_seed(config.seed)
        model = build_model(spec, load_weights(self.model_path), self.dtype, self.device)
        self.vocab_size = spec.vocab_size
        self.block_size = config.block_size
        draft_model = None
        if config.speculative_model not in (None, NGRAM):
            draft_model = load_draft_model(
                config.speculative_model,
                self.tokenizer,
                self.vocab_size,
                self.max_model_len,
                self.dtype,
                self.device,
            )
        # a draft's KV blocks mirror the target's, so each block costs both
        block_bytes = sum(
            ModelRunner.bytes_per_block(m, self.block_size, self.dtype) for m in (model, draft_model) if m
        )
        num_blocks = kv_cache_bytes(config, model, self.device, self.dtype, self.attention) // block_bytes
        if num_blocks < 1:
            raise ValueError("kv_cache_memory: too small for even one KV block")
        max_batched = config.max_num_batched_tokens
        if not config.enable_chunked_prefill:
            max_batched = max(max_batched, self.max_model_len)  # a whole prompt must fit one step
        self.pool = BlockPool(num_blocks, config.enable_prefix_caching)
        self.kv = KVCacheManager(
            self.pool, self.block_size, -(-self.max_model_len // self.block_size) + 1, config.max_num_seqs
        )
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            max_batched,
            config.enable_chunked_prefill,
            config.max_waiting_seqs,
            config.waiting_tokens_for(self.device.type),
        )
        self.runner = ModelRunner(model, num_blocks, self.block_size, self.device, self.dtype, self.attention)
        self.attention.prepare(self.device, self.dtype)
        if self.device.type == "cuda" and not config.enforce_eager:
            if self.attention.graph_safe:
                self.runner.enable_decode_graphs(config.max_num_seqs, self.max_model_len)
            else:
                log.info("no CUDA graphs: the %s attention backend cannot be captured", self.attention.name)
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        self.ngram = self.draft = None
        if config.speculative_model == NGRAM:
            self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        elif draft_model is not None:
            self.draft = DraftProposer(
                draft_model, num_blocks, self.block_size, self.device, self.dtype, self.attention
            )
        self.backoff = SpecBackoff(config.speculative_disable_by_batch_size)
        self.num_draft_tokens = 0  # proposals verified, all requests
        self.num_accepted_tokens = 0  # of which accepted
        self.first_scheduled: list[Request] = []  # requests the last step scheduled for the first time
        # structured outputs: grammars compiled for this tokenizer (built on first use), and the requests
        # queued while theirs compiles
        self._grammars: Grammars | None = None
        self.compiling: list[Request] = []
        self.mask_seconds = 0.0  # spent building and applying token masks, for bench/structured_outputs.py
        capacity = num_blocks * self.block_size
        log.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB, %s) = %d tokens; %.1f requests of max_model_len %d fit",
            num_blocks,
            self.block_size,
            num_blocks * block_bytes / 2**30,
            self.dtype,
            capacity,
            capacity / self.max_model_len,
            self.max_model_len,
        )

    # -- requests ---------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> Request:
        """Validate and queue; a bad request raises ValueError naming the field and touches nothing else."""
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        token_ids = self._prompt_token_ids(prompt)
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt: {len(token_ids)} prompt tokens + max_tokens {params.max_tokens} = {total} "
                f"exceeds max_model_len {self.max_model_len}"
            )
        if -(-total // self.block_size) > self.pool.num_blocks:
            raise ValueError(
                f"prompt: {len(token_ids)} prompt tokens + max_tokens {params.max_tokens} need more KV blocks "
                f"than the whole pool holds ({self.pool.num_blocks} x {self.block_size} tokens)"
            )
        bad = next((t for t in params.logit_bias if t >= self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"logit_bias: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        grammar = None
        if params.structured_outputs is not None:  # structured outputs hook
            grammar = self.grammars.start(params.structured_outputs)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(self.device).manual_seed(params.seed)
        request = Request(
            request_id,
            token_ids,
            params,
            self.eos_token_ids,
            cache_salt=cache_salt,
            generator=generator,
            grammar=grammar,
        )
        self.requests[request_id] = request
        if grammar is not None and not grammar.ready:
            self.compiling.append(request)
        self.scheduler.add(request)
        return request

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False if it is unknown or already finished."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self._finish(request, "abort")
        return True

    @property
    def queue_full(self) -> bool:
        """The waiting queue is at its bound (--max-waiting-seqs / --max-waiting-tokens)."""
        return self.scheduler.queue_full

    def hand_back_overdue(self) -> list[str]:
        """Drop the requests that have waited --max-waiting-time without starting, so their gateways can send
        them to an executor with room: the ids, none of which has computed or sent anything."""
        if not self.config.max_waiting_time:
            return []
        cutoff = time.time_ns() - int(self.config.max_waiting_time * 1e9)
        overdue = [r.request_id for r in self.scheduler.unstarted_since(cutoff)]
        for request_id in overdue:
            self.abort(request_id)
        return overdue

    @property
    def grammars(self) -> Grammars:
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammars

    def _refuse_failed_grammars(self) -> list[StepOutput]:
        """Structured outputs: requests whose grammar failed while they waited end with its error (a 400)."""
        refused, still = [], []
        for request in self.compiling:
            if request.status is RequestStatus.FINISHED or request.grammar.ready:
                continue
            if request.grammar.error is None:
                still.append(request)
                continue
            self.requests.pop(request.request_id, None)
            self._finish(request, "error")
            refused.append(StepOutput(request.request_id, [], [], "error", 0, error=request.grammar.error))
        self.compiling = still
        return refused

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def _prompt_token_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, list | tuple) or not all(isinstance(t, int) for t in prompt):
            raise ValueError("prompt: expected a string or a list of token ids")
        if not prompt:
            raise ValueError("prompt_token_ids: must not be empty")
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"prompt_token_ids: token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )
        return list(prompt)

    # -- the step ---------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        refused = self._refuse_failed_grammars() if self.compiling else []
        sched = self.scheduler.schedule()
        now = time.time_ns()
        self.first_scheduled = [r for r, _ in sched.scheduled if not r.first_scheduled_ns]
        for request in self.first_scheduled:
            request.first_scheduled_ns = now
        if not sched.scheduled:
            if self.compiling:  # nothing else to do until a grammar is ready: wait for one, briefly
                wait([r.grammar.future for r in self.compiling], timeout=0.05, return_when=FIRST_COMPLETED)
            elif self.scheduler.num_unfinished:
                raise RuntimeError(
                    "scheduler made no progress with requests waiting"
                )  # admission forbids this
            return refused
        self._zero_fresh_blocks()
        step = self.runner.execute(sched.scheduled, self.kv)
        for request, n in sched.scheduled:
            request.num_computed_tokens += n
        outputs, finished = [], []
        sampled = self._sample(step)
        now = time.time_ns()
        for request, token_ids, logprobs in zip(step.requests, *sampled, strict=True):
            request.first_token_ns = request.first_token_ns or now
            out = self._advance(request, token_ids, logprobs)
            outputs.append(out)
            if out.finish_reason is not None:
                finished.append(request)
        if self.ngram is not None or self.draft is not None:
            self._propose(step.requests, finished)
        for request, _ in sched.scheduled:
            self.kv.cache_full_blocks(request)
        for request in finished:
            self.requests.pop(request.request_id, None)
            self._finish(request, request.finish_reason)
        return refused + outputs

    def _sample(self, step) -> tuple[list[list[int]], list[list[TokenLogprobs | None]]]:
        """Each request's new tokens: one sampled, or its accepted proposals and one more when it verifies."""
        rows = [
            SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids, r.generator) for r in step.requests
        ]
        if not rows:
            return [], []
        drafts = [r.spec_token_ids for r in step.requests]
        # structured outputs: constrained rows' disallowed tokens to -inf, before sampling and logprobs
        started = time.perf_counter()
        mask = step_bitmask([r.grammar for r in step.requests], drafts, self.vocab_size)
        if mask is not None:
            mask.apply(step.logits)
            self.mask_seconds += time.perf_counter() - started
        if all(n == 1 for n in step.num_rows):
            result = self.sampler(step.logits, rows)
            return [[t] for t in result.token_ids], [[lp] for lp in result.logprobs]
        verified = verify(step.logits, rows, drafts, [r.draft_probs for r in step.requests])
        return verified.token_ids, verified.logprobs

    def _advance(self, request: Request, token_ids: list[int], logprobs: list) -> StepOutput:
        """Append the step's tokens up to a stop; give back the KV positions of rejected proposals."""
        num_proposed, num_accepted = len(request.spec_token_ids), len(token_ids) - 1
        if num_proposed:
            request.num_draft_tokens += num_proposed
            request.num_accepted_tokens += num_accepted
            self.num_draft_tokens += num_proposed
            self.num_accepted_tokens += num_accepted
            self.backoff.record(request.request_id, num_proposed, num_accepted)
            # the draft wrote KV for all its proposals but the last while proposing
            request.num_draft_computed += min(num_accepted, num_proposed - 1)
            # the rejected positions' KV is garbage: forget it (later tokens overwrite those slots)
            request.num_computed_tokens -= num_proposed - num_accepted
            request.set_spec_tokens([])
        reason, kept = None, 0
        while reason is None and kept < len(token_ids):  # a stop inside an accepted run ends it there
            request.append_token(token_ids[kept])
            kept += 1
            reason = request.check_stop(self.max_model_len)
            if request.grammar is not None and request.grammar.accept(token_ids[kept - 1]):
                reason = "stop"  # structured outputs: the grammar is complete
        del token_ids[kept:], logprobs[kept:]
        # all but the newest token have KV (fewer when a stop cut the run short)
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        request.finish_reason = reason
        return StepOutput(
            request.request_id,
            token_ids,
            logprobs,
            reason,
            request.num_cached_tokens,
            request.num_accepted_tokens,
        )

    def _propose(self, sampled: list[Request], finished: list[Request]) -> None:
        """Proposals for the next step, from requests the back-off rule lets speculate (spec_decode/backoff.py)."""
        done = set(finished)
        if not self.backoff.batch_allows(len(self.scheduler.running) - len(done)):
            return
        k_max = self.config.num_speculative_tokens
        work = []
        for request in sampled:
            if request in done or not self.backoff.request_allows(request.request_id):
                continue
            # the run it emits (accepted proposals + one) must fit max_tokens and max_model_len
            k = min(k_max, request.num_tokens_left(self.max_model_len) - 1)
            if k < 1:
                continue
            if self.ngram is not None:
                request.set_spec_tokens(self.ngram.propose(request.token_ids, k))
            # the draft writes KV for the new token and k - 1 proposals past it, beyond the slots this step
            # allocated: never preempt for that
            elif self.kv.allocate(request, k):
                work.append((request, k))
        if work:
            self._zero_fresh_blocks()  # before the draft writes into blocks it just took
            self.draft.propose(work, self.kv)
        for request in sampled:  # structured outputs: one-hot proposals stop where the grammar refuses one
            # (cutting drawn ones by their value would bias rejection sampling; verification rejects them)
            if request.grammar is not None and request.spec_token_ids and request.draft_probs is None:
                request.truncate_spec_tokens(request.grammar.valid_prefix(request.spec_token_ids))

    def _zero_fresh_blocks(self) -> None:
        fresh = self.pool.drain_fresh()
        self.runner.zero_blocks(fresh)
        if self.draft is not None:
            self.draft.runner.zero_blocks(fresh)

    def _finish(self, request: Request, reason: str) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finished_ns = time.time_ns()
        self.scheduler.remove(request)
        self.backoff.forget(request.request_id)

    # -- introspection ----------------------------------------------------------------------------

    def load(self) -> dict[str, float]:
        """What routing needs, cheap enough to publish every step (stats() walks every block table)."""
        queued = [*self.scheduler.running, *self.scheduler.waiting]
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            # prompt tokens still to prefill: the work a new request waits behind
            "prefill_tokens": sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in queued),
            "kv_usage": self.pool.num_used_blocks / self.pool.num_blocks,
            "queue_full": int(self.queue_full),
        }

    def counters(self) -> dict[str, int]:
        """The cumulative counts since start, cheap enough to publish several times a second."""
        return {
            "prefix_cache_queries": self.scheduler.prefix_cache_queries,
            "prefix_cache_hits": self.scheduler.prefix_cache_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "spec_draft_tokens": self.num_draft_tokens,
            "spec_accepted_tokens": self.num_accepted_tokens,
            "structured_output_mask_seconds": self.mask_seconds,
        }

    def stats(self) -> dict[str, float]:
        filled: dict[int, int] = {}
        for request in self.scheduler.running:
            table = self.kv.tables.get(request.request_id, [])
            for i, block in enumerate(table):
                n = min(self.block_size, max(0, request.num_computed_tokens - i * self.block_size))
                filled[block.block_id] = max(filled.get(block.block_id, 0), n)
        return {
            "kv_blocks_total": self.pool.num_blocks,
            "kv_blocks_used": self.pool.num_used_blocks,
            "block_size": self.block_size,
            "kv_tokens_stored": sum(filled.values()),
            **self.counters(),
            "spec_acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens
            if self.num_draft_tokens
            else 0.0,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
        }


def _max_model_len(asked: int | None, spec) -> int:
    """The model's context length, kept within a sliding window: attention here always sees the whole context,
    which equals sliding-window attention only while the context fits the window."""
    limit, what = spec.max_position, "context length"
    if spec.sliding_window is not None and spec.sliding_window < limit:
        limit, what = spec.sliding_window, "sliding window"
    if asked is None:
        return limit
    if asked > limit:
        raise ValueError(f"max_model_len {asked} exceeds the model's {what} {limit}")
    return asked


def _eos_token_ids(hf_config, model_path, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(source)
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(model_path, local_files_only=True)
        eos = gen.eos_token_id
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    except OSError:
        pass  # no generation_config.json
    return frozenset(ids)
