"""The engine: requests in, one scheduled step at a time, new tokens out."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

import torch

from executor.engine_busy import EngineBusy
from executor.engine_config import EngineConfig
from executor.engine_setup import (
    build_proposers,
    build_runner,
    build_scheduler,
    load_models,
    log_kv_capacity,
    num_kv_blocks,
)
from executor.grammars import Grammars, RequestGrammar, step_bitmask
from executor.kv_block_seconds import KVBlockSeconds
from executor.kv_sizing import pick_device_and_dtype
from executor.model_runner import PROMPT_LOGITS_ROWS, StepLogits
from executor.request import Request
from executor.sampler import Sampler, SamplingRow, TokenLogprobs, logprobs_of
from executor.sampling_state import PromptTerms, SamplingState
from executor.scheduler import NewTokens, SchedulerOutput
from executor.spec_decode import SpecBackoff, verify
from executor.waiting_queue import TENANTS_SHARE
from kernels.backend import choose_attention_backend
from shared.block_hash import hash_blocks
from shared.protocol import MAX_TENANT_WEIGHT
from shared.sampling_params import SamplingParams
from shared.structured_outputs import StructuredOutputsParams

log = logging.getLogger("kvserve.engine")

HASHES_CHECKED = 4  # leading blocks of a prompt whose gateway hashes are compared with the engine's


def choice_request_id(group_id: str, index: int) -> str:
    """The engine's own id for choice index > 0 of a request with n > 1 (choice 0 keeps the request's id)."""
    return f"{group_id}/{index}"


@dataclass(slots=True)
class StepOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None]
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    num_cached_tokens: int
    num_accepted_tokens: int = 0  # proposals of this request the target has accepted so far
    error: str | None = None  # refused after it was queued (its grammar failed to compile): the message
    error_code: int = 400  # 400 when the spec was at fault, 500 when the engine was
    # params.prompt_logprobs: every prompt token's but the first (which has none), with its first new token
    prompt_logprobs: list[TokenLogprobs] | None = None
    index: int = 0  # the choice (parallel sampling, n > 1); request_id is the whole group's
    group_finished: bool = True  # no choice of the group runs any more: its last output


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.device, self.dtype = pick_device_and_dtype(config.device, config.dtype)
        config = dataclasses.replace(
            config, max_num_batched_tokens=config.batched_tokens_for(self.device.type)
        )
        self.config = config
        self.attention = choose_attention_backend(config.attention_backend, self.device)
        models = load_models(config, self.device, self.dtype)
        self.model_path, self.tokenizer = models.path, models.tokenizer
        self.eos_token_ids, self.vocab_size = models.eos_token_ids, models.vocab_size
        self.max_model_len = models.max_model_len
        self.block_size = config.block_size
        num_blocks, block_bytes = num_kv_blocks(config, models, self.device, self.dtype, self.attention)
        self.scheduler = build_scheduler(config, num_blocks, self.max_model_len, self.device)
        self.kv, self.pool = self.scheduler.kv, self.scheduler.kv.pool
        self.kv_block_seconds = KVBlockSeconds(self.kv)  # each request's, for its tenant's bill
        self.runner = build_runner(
            config, models.target, num_blocks, self.max_model_len, self.device, self.dtype, self.attention
        )
        self.ngram, self.draft = build_proposers(
            config, models.draft, num_blocks, self.device, self.dtype, self.attention
        )
        self.backoff = SpecBackoff(config.speculative_disable_by_batch_size)
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}  # unfinished, by their own id (a choice's, for n > 1)
        self.groups: dict[str, list[Request]] = {}  # by the id they were added under: every choice
        self.first_scheduled: list[Request] = []  # requests the last step scheduled for the first time
        self.block_hash_mismatches = 0  # requests whose gateway hashed their prompt otherwise
        # structured outputs: grammars compiled for this tokenizer (built on first use, with the process that
        # compiles them), and the requests whose grammar compiles, held here rather than in the scheduler's
        # bounded queue until it is ready (a bounded number of them: _check_compile_room)
        self._grammars: Grammars | None = None
        self.compiling: list[Request] = []
        self.mask_seconds = 0.0  # spent building and applying token masks, for bench/structured_outputs.py
        log_kv_capacity(num_blocks, block_bytes, self.block_size, self.dtype, self.max_model_len)

    # -- requests ---------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        block_hashes: Sequence[bytes] = (),
        tenant: str | None = None,
        weight: float = 1.0,
        priority: int = 0,
    ) -> Request:
        """Validate and queue; a bad request raises ValueError naming the field and touches nothing else, one
        that must wait for a compile while too many do raises EngineBusy. block_hashes: the prompt's chain as the
        gateway hashed it, checked against this engine's own."""
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        if not 0 < weight <= MAX_TENANT_WEIGHT:  # the fair share divides service by it
            raise ValueError(f"weight: a tenant's weight must be in (0, {MAX_TENANT_WEIGHT:g}], got {weight}")
        token_ids = self._prompt_token_ids(prompt)
        self._check_fits(len(token_ids), params)
        bad = next((t for t in params.logit_bias if t >= self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"logit_bias: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        ids = [request_id] + [choice_request_id(request_id, i) for i in range(1, params.n)]
        taken = next((i for i in ids if i in self.requests or i in self.groups), None)
        if taken is not None:
            raise ValueError(f"request_id: {taken!r} is already in use")
        spec = params.structured_outputs
        compiled = None if spec is None else self._compiled_grammar(spec, cache_salt)
        prompt_terms = PromptTerms(params, token_ids)  # built once, at the first step, for every choice
        choices = [
            Request(
                choice_id,
                token_ids,
                params,
                self.eos_token_ids,
                cache_salt=cache_salt,
                tenant=tenant,
                weight=weight,
                priority=priority,
                generator=self._generator(params.choice_seed(index)),
                grammar=None if compiled is None else RequestGrammar(compiled),  # a matcher each
                group_id=request_id,
                index=index,
                sampling_state=SamplingState(prompt_terms),
            )
            for index, choice_id in enumerate(ids)
        ]
        request, request.forks = choices[0], choices[1:]
        if block_hashes:
            self._check_block_hashes(request, block_hashes)
        for choice in choices:
            self.requests[choice.request_id] = choice
        self.groups[request_id] = choices
        if compiled is not None and not compiled.done():
            self.compiling.append(request)  # to the scheduler once its grammar is ready (_admit_compiled)
        else:
            self.scheduler.add(request)
        return request

    @property
    def waiting_tenants_share(self) -> int:
        """All tenants together may have this many times --max-waiting-seqs waiting (1: one bound for all)."""
        return TENANTS_SHARE if self.config.fair_share else 1

    def is_compiling(self, request_id: str) -> bool:
        """The request waits for its grammar, outside the waiting queue."""
        return any(r.request_id == request_id for r in self.compiling)

    def _compiled_grammar(self, spec: StructuredOutputsParams, cache_salt: str | None) -> Future:
        """Structured outputs: the tenant's grammar for spec, compiled or compiling. Raises the ValueError of one
        known to fail, and EngineBusy for one that would wait for a compile without room to."""
        known = self.grammars.lookup(spec, cache_salt)
        if known is None or not known.done():
            self._check_compile_room(cache_salt)
        compiled = self.grammars.compile(spec, cache_salt)
        if compiled.done() and compiled.exception() is not None:  # cached, so the spec's own: a ValueError
            raise ValueError(str(compiled.exception()))
        return compiled

    def _check_compile_room(self, cache_salt: str | None) -> None:
        """EngineBusy unless a request of this tenant may wait for its grammar: one tenant has at most
        --max-waiting-seqs waiting, all tenants together TENANTS_SHARE times that (as in the waiting queue)."""
        per_tenant = self.config.max_waiting_seqs
        own = sum(1 for r in self.compiling if r.cache_salt == cache_salt)
        if own >= per_tenant:
            raise EngineBusy(
                f"executor busy: {own} of this tenant's requests already wait for their grammars to compile"
            )
        if len(self.compiling) >= TENANTS_SHARE * per_tenant:
            raise EngineBusy(
                f"executor busy: {len(self.compiling)} requests already wait for their grammars to compile"
            )

    def _check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Refuse what could never run: past max_model_len, or more blocks than the pool holds for the whole
        group (the prompt's full blocks once, then each choice's own), or more choices than --max-num-seqs."""
        total = num_prompt_tokens + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt: {num_prompt_tokens} prompt tokens + max_tokens {params.max_tokens} = {total} "
                f"exceeds max_model_len {self.max_model_len}"
            )
        if params.n > self.config.max_num_seqs:
            raise ValueError(
                f"n: {params.n} choices exceed this executor's max_num_seqs {self.config.max_num_seqs}"
            )
        shared = num_prompt_tokens // self.block_size
        needed = shared + params.n * (-(-total // self.block_size) - shared)
        if needed > self.pool.num_blocks:
            what = f"n {params.n} x " if params.n > 1 else ""
            raise ValueError(
                f"prompt: {num_prompt_tokens} prompt tokens + {what}max_tokens {params.max_tokens} need more "
                f"KV blocks than the whole pool holds ({self.pool.num_blocks} x {self.block_size} tokens)"
            )

    def _generator(self, seed: int | None) -> torch.Generator | None:
        return None if seed is None else torch.Generator(self.device).manual_seed(seed)

    def _check_block_hashes(self, request: Request, sent: Sequence[bytes]) -> None:
        """Compare the gateway's first block hashes with this engine's chain: where they disagree, routing by
        cached prefix finds nothing here, and the hit rate drops to 0 without a word otherwise."""
        n = min(len(sent), HASHES_CHECKED)
        request.block_hashes = hash_blocks(
            request.token_ids[: n * self.block_size], self.block_size, request.cache_salt
        )
        if list(sent[:n]) == request.block_hashes:
            return
        self.block_hash_mismatches += 1
        if self.block_hash_mismatches == 1:
            log.warning(
                "request %s: the gateway's block hashes differ from this executor's (block size %d): likely a "
                "gateway and executor that disagree on block size, cache salt or hash function; prefix-cache "
                "routing to this executor will miss (counted in kvserve_block_hash_mismatches_total, this "
                "warning once)",
                request.request_id,
                self.block_size,
            )

    def abort(self, request_id: str, index: int | None = None) -> list[int]:
        """Stop a request, every choice of it or only choice index, and free their blocks; the indexes of the
        choices it stopped (none: unknown or already finished). A choice still to fork from the first one ends
        with it, since the prompt it waits for is the first one's."""
        group = self.groups.get(request_id, [])
        stopped = [c for c in group if c.request_id in self.requests and index in (None, c.index)]
        if any(c.forks for c in stopped):
            stopped = [c for c in group if c.request_id in self.requests]
        for choice in stopped:
            self._forget(choice)
            self.scheduler.finish(choice, "abort")
            if choice in self.compiling:
                self._stop_compiling(choice)
        return sorted({c.index for c in stopped})

    def _stop_compiling(self, request: Request) -> None:
        """A request no longer waits for its grammar: the compile is dropped unless another request waits too."""
        self.compiling.remove(request)
        future = request.grammar.future
        if not any(r.grammar.future is future for r in self.compiling):
            self.grammars.cancel(future)

    def _forget(self, request: Request) -> bool:
        """Drop a finishing choice; whether it was its group's last."""
        self.kv_block_seconds.settle(request)
        self.requests.pop(request.request_id, None)
        self.backoff.forget(request.request_id)
        group = self.groups.get(request.group_id, [])
        if any(c.request_id in self.requests for c in group):
            return False
        self.groups.pop(request.group_id, None)
        return True

    @property
    def queue_full(self) -> bool:
        """The waiting queue is at its bound, every tenant's places taken (executor/waiting_queue.py)."""
        return self.scheduler.queue_full

    def queue_full_for(self, tenant: str | None) -> bool:
        """A new request of tenant's finds no place in the waiting queue: its own places (--max-waiting-seqs,
        --max-waiting-tokens) are taken, or all tenants' together."""
        return self.scheduler.queue_full_for(tenant)

    def hand_back_overdue(self) -> list[str]:
        """Drop the requests that have waited --max-waiting-time without starting, so their gateways can send
        them to an executor with room: the ids, none of which has computed or sent anything. The time counts in
        the scheduler's queue: one waiting for its grammar waits for work no other executor has done."""
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
            self._grammars = Grammars(
                self.tokenizer, self.vocab_size, self.eos_token_ids, self.config.grammar_compile_timeout
            )
        return self._grammars

    def _admit_compiled(self) -> list[StepOutput]:
        """Structured outputs: requests whose grammar is ready join the scheduler's queue, in arrival order;
        those whose grammar failed end with its error (a 400, or a 500 where the fault was the engine's)."""
        refused, still = [], []
        for request in self.compiling:
            if request.grammar.ready:
                self.scheduler.add(request)
                continue
            error = request.grammar.error
            if error is None:
                still.append(request)
                continue
            for choice in [request, *request.forks]:  # none has started: they wait for the first one's prompt
                self._forget(choice)
                self.scheduler.finish(choice, "error")
            code = 400 if isinstance(error, ValueError) else 500
            refused.append(
                StepOutput(request.group_id, [], [], "error", 0, error=str(error), error_code=code)
            )
        self.compiling = still
        return refused

    def close(self) -> None:
        """Let go of what outlives the engine's own objects: the grammar compile process and its thread."""
        if self._grammars is not None:
            self._grammars.close()

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
        """Schedule, run the model (sample, verify proposals), let the scheduler book it, propose for the next."""
        refused = self._admit_compiled() if self.compiling else []
        sched = self.scheduler.schedule()
        self.kv_block_seconds.charge(self.scheduler.running)
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
        self._prepare_blocks()
        step = self.runner.execute(sched.scheduled, self.kv)
        if step.prompt_rows:
            self._score_prompts(step)
        step = self._fork(sched, step)  # after scoring: forks start past the prompt and score none of it
        token_ids, logprobs = self._sample(step)
        news = self.scheduler.update_from_output(sched, step.requests, token_ids)
        now = time.time_ns()
        outputs = [self._output(new, lp, now) for new, lp in zip(news, logprobs, strict=True)]
        if self.ngram is not None or self.draft is not None:
            self._propose([new.request for new in news if new.request.finish_reason is None])
        return refused + outputs

    def _output(self, new: NewTokens, logprobs: list[TokenLogprobs | None], now: int) -> StepOutput:
        """A sampled request's StepOutput; what the scheduler booked also feeds the back-off rule."""
        request = new.request
        request.first_token_ns = request.first_token_ns or now
        if new.num_proposed:
            self.backoff.record(request.request_id, new.num_proposed, new.num_accepted)
        group_finished = request.finish_reason is not None and self._forget(request)
        prompt_logprobs = None
        if request.prompt_logprobs is not None and not request.num_prompt_tokens_to_score:
            prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, None  # sent once
        return StepOutput(
            request.group_id,
            new.token_ids,
            logprobs[: len(new.token_ids)],
            request.finish_reason,
            request.num_cached_tokens,
            request.num_accepted_tokens,
            prompt_logprobs=prompt_logprobs,
            index=request.index,
            group_finished=group_finished,
        )

    def _score_prompts(self, step) -> None:
        """Prompt logprobs from the rows of this step's forward pass: raw distribution, log-softmax in float32,
        PROMPT_LOGITS_ROWS rows of logits at a time."""
        targets, num_top = [], []
        for request, first, count in step.prompt_rows:
            targets += request.prompt_token_ids[first : first + count]
            num_top += [request.params.prompt_logprobs] * count
        index = torch.tensor(targets, device=step.prompt_hidden.device)
        scored: list[TokenLogprobs] = []
        for start in range(0, len(targets), PROMPT_LOGITS_ROWS):
            end = start + PROMPT_LOGITS_ROWS
            logits = self.runner.logits(step.prompt_hidden[start:end])
            scored += logprobs_of(logits, index[start:end], num_top[start:end])
        done = 0
        for request, first, count in step.prompt_rows:
            request.prompt_logprobs += scored[done : done + count]
            request.num_scored_prompt_tokens = first + count
            done += count

    def _fork(self, sched: SchedulerOutput, step: StepLogits) -> StepLogits:
        """Parallel sampling: a group whose prompt this step finished becomes its n choices, each sampling its
        first token from the prompt's one row of logits (a copy each, as masks and penalties work in place)."""
        if not any(r.forks for r in step.requests):
            return step
        requests, num_rows, rows, offset = [], [], [], 0
        for request, n in zip(step.requests, step.num_rows, strict=True):
            group = [request, *self.scheduler.fork(sched, request)] if request.forks else [request]
            for choice in group:
                requests.append(choice)
                num_rows.append(n)
                rows.extend(range(offset, offset + n))
            offset += n
        index = torch.tensor(rows, device=step.logits.device)
        return StepLogits(
            requests, step.logits.index_select(0, index), num_rows, step.prompt_rows, step.prompt_hidden
        )

    def _sample(self, step) -> tuple[list[list[int]], list[list[TokenLogprobs | None]]]:
        """Each request's new tokens: one sampled, or its accepted proposals and one more when it verifies."""
        rows = [SamplingRow(r.sampling_state, r.generator) for r in step.requests]
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

    def _propose(self, sampled: list[Request]) -> None:
        """Proposals for the next step, from requests the back-off rule lets speculate (spec_decode/backoff.py)."""
        if not self.backoff.batch_allows(len(self.scheduler.running)):
            return
        k_max = self.config.num_speculative_tokens
        work = []
        for request in sampled:
            if not self.backoff.request_allows(request.request_id):
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
            self._prepare_blocks()  # before the draft writes into blocks it just took
            self.draft.propose(work, self.kv)
        for request in sampled:  # structured outputs: one-hot proposals stop where the grammar refuses one
            # (cutting drawn ones by their value would bias rejection sampling; verification rejects them)
            if request.grammar is not None and request.spec_token_ids and request.draft_probs is None:
                request.truncate_spec_tokens(request.grammar.valid_prefix(request.spec_token_ids))

    def _prepare_blocks(self) -> None:
        """Before a forward pass writes into blocks just handed out: fill copy-on-write copies from the blocks
        they were copied from (in the draft model's cache too)."""
        copies = self.kv.drain_copies()
        runners = [self.runner] if self.draft is None else [self.runner, self.draft.runner]
        for runner in runners:
            runner.copy_blocks(copies)

    # -- introspection ----------------------------------------------------------------------------

    def load(self) -> dict[str, float]:
        """What routing needs, cheap enough to publish every step (stats() walks every block table)."""
        waiting = [*self.scheduler.waiting, *self.compiling]  # the latter will need their prefill too
        queued = [*self.scheduler.running, *waiting]
        return {
            "running": len(self.scheduler.running),
            "waiting": len(waiting),
            "compiling": len(self.compiling),  # of waiting: not in the waiting queue's places
            "waiting_max_tenant": self.scheduler.waiting.max_per_tenant,  # the most places one tenant holds
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
            "spec_draft_tokens": self.scheduler.spec_draft_tokens,
            "spec_accepted_tokens": self.scheduler.spec_accepted_tokens,
            "block_hash_mismatches": self.block_hash_mismatches,
            "structured_output_mask_seconds": self.mask_seconds,
        }

    def stats(self) -> dict[str, float]:
        return {
            "kv_blocks_total": self.pool.num_blocks,
            "kv_blocks_used": self.pool.num_used_blocks,
            "block_size": self.block_size,
            "kv_tokens_stored": self.kv.num_tokens_stored(self.scheduler.running),
            **self.counters(),
            "spec_acceptance_rate": self.scheduler.spec_accepted_tokens / self.scheduler.spec_draft_tokens
            if self.scheduler.spec_draft_tokens
            else 0.0,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting) + len(self.compiling),
            "num_compiling": len(self.compiling),  # of which wait for their grammar
        }
