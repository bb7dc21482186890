"""The engine: requests in, one scheduled step at a time, new tokens out.

A step: requests whose grammar is ready join the scheduler's queue; the scheduler decides what runs; the model
runner computes it and the step sampler turns its logits into tokens; the scheduler books what came out
(update_from_output); then proposals for the next step. Requests come in through the intake (executor/intake.py),
which holds the one map of unfinished requests; what callers see is add_request, abort, step and stats.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

from executor.cpu_threads import cpu_threads_for
from executor.engine_config import EngineConfig
from executor.engine_setup import (
    build_adapters,
    build_kv_tiers,
    build_proposers,
    build_runner,
    build_scheduler,
    load_models,
    log_kv_capacity,
    num_kv_blocks,
)
from executor.intake import Intake
from executor.kv.block_seconds import KVBlockSeconds
from executor.kv.sizing import pick_device_and_dtype
from executor.lora.adapter_loads import AdapterLoads
from executor.request import Request
from executor.sampling.sampler import TokenLogprobs
from executor.sampling.step_sampler import StepSampler
from executor.scheduling.scheduler import NewTokens
from executor.scheduling.waiting_queue import TENANTS_SHARE
from executor.spec_decode import SpecBackoff
from executor.step_result import EngineStats, StepOutput, StepResult
from executor.structured.grammar_queue import GrammarQueue
from executor.structured.grammars import Grammars
from kvkernels.backend import choose_kernels
from shared.sampling_params import SamplingParams
from shared.structured_outputs import StructuredOutputsParams
from shared.tenant import ANONYMOUS_TENANT, Tenant

if TYPE_CHECKING:
    from shared.protocol import KVPeer

GRAMMAR_WAIT_S = 0.05  # an idle step waits this long at most for a grammar to be ready


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.device, self.dtype = pick_device_and_dtype(config.device, config.dtype)
        self.kernels = choose_kernels(config.attention_backend, self.device)
        models = load_models(config, self.device, self.dtype, self.kernels)
        self.config = config = config.resolved(self.device.type, models.max_model_len)
        self.model_path, self.tokenizer = models.path, models.tokenizer
        self.eos_token_ids, self.vocab_size = models.eos_token_ids, models.vocab_size
        self.max_model_len = models.max_model_len
        self.block_size = config.block_size
        num_blocks, block_bytes = num_kv_blocks(config, models, self.device, self.dtype)
        self.scheduler = build_scheduler(config, num_blocks, self.max_model_len)
        self.kv = self.scheduler.kv
        self.kv.pool.start_recording_events()  # each step hands out what it cached and evicted
        self.kv_block_seconds = KVBlockSeconds(self.kv)  # each request's, for its tenant's bill
        self.runner = build_runner(
            config, models.target, num_blocks, self.max_model_len, self.device, self.dtype
        )
        self.ngram, self.draft = build_proposers(config, models.draft, num_blocks, self.device, self.dtype)
        self.backoff = SpecBackoff(config.speculative_disable_by_batch_size)
        self.sampling = StepSampler(self.runner, self.vocab_size)
        self.grammar_queue = GrammarQueue(models.tokenizer, models.vocab_size, models.eos_token_ids, config)
        self.adapters = build_adapters(config, models, self.device, self.dtype)
        self.adapter_loads = None if self.adapters is None else AdapterLoads(self.adapters)
        self.intake = Intake(models, config, num_blocks, self.device, self.grammar_queue, self.adapters)
        log_kv_capacity(num_blocks, block_bytes, self.block_size, self.dtype, self.max_model_len)
        self.cpu_threads = cpu_threads_for(config.adaptive_cpu_threads, self.device, self.dtype)
        self.kv_tiers = build_kv_tiers(config, models, self.kv, self.runner.kv_cache, self.device, self.dtype)

    # -- requests ---------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        tenant: Tenant = ANONYMOUS_TENANT,
        block_hashes: Sequence[bytes] = (),
        priority: int = 0,
        kv_peer: KVPeer | None = None,
        lora: str | None = None,
    ) -> list[Request]:
        """Validate and queue; the request's choices (n > 1), the first carrying the prompt. A bad request raises
        ValueError naming the field and touches nothing else, one that must wait for a compile while too many do
        raises EngineBusy. block_hashes: the prompt's chain as the gateway hashed it, checked against the engine's;
        kv_peer: the executor that holds the prompt's first blocks, to pull those this one lacks; lora: the name
        of the LoRA adapter it runs under (None: the base model)."""
        choices = self.intake.add(request_id, prompt, params, tenant, block_hashes, priority, lora)
        request = choices[0]
        request.kv_peer = kv_peer
        if request.grammar is not None and not request.grammar.future.done():
            self.grammar_queue.hold(request)  # to the scheduler once its grammar is ready (_admit_compiled)
        else:
            self._enqueue(request)
        return choices

    def load_adapter(self, name: str) -> None:
        """Have the adapter's weights in host memory now (the offline API's way: it may wait)."""
        known = self.intake.known_adapter(name)
        self.adapters.keep(
            self.adapters.held(known) or self.adapters.load(known), self.intake.adapters_in_use()
        )

    def _enqueue(self, request: Request) -> None:
        """To the scheduler, or first to its adapter's load and to the tiers when they hold blocks of its prefix
        the pool lacks (on from there once loaded: step)."""
        if self.adapter_loads is not None and self.adapter_loads.hold(request):
            return
        if self.kv_tiers is None or not self.kv_tiers.start_load(request):
            self.scheduler.add(request)

    def abort(self, request_id: str, index: int | None = None) -> list[int]:
        """Stop a request, every choice of it or only choice index, and free their blocks; the indexes of the
        choices it stopped (none: unknown or already finished)."""
        stopped = self.intake.stopping(request_id, index)
        for choice in stopped:
            self._end(choice, "abort")
            self.grammar_queue.drop(choice)
            if self.adapter_loads is not None:
                self.adapter_loads.drop(choice)
        return sorted({c.index for c in stopped})

    def _end(self, request: Request, reason: str) -> bool:
        """A choice ends outside a step (aborted, or its grammar failed); whether it was its group's last."""
        last = self._forget(request)
        self.scheduler.finish(request, reason)
        if self.kv_tiers is not None:
            self.kv_tiers.drop(request)
        return last

    def _forget(self, request: Request) -> bool:
        """Drop a finishing choice; whether it was its group's last."""
        self.kv_block_seconds.settle(request)
        self.backoff.forget(request.request_id)
        return self.intake.forget(request)

    def is_unfinished(self, request_id: str) -> bool:
        """Some choice of the request added under this id still runs or waits."""
        return request_id in self.intake.groups

    def has_unfinished(self) -> bool:
        return bool(self.intake.requests)

    def is_compiling(self, request_id: str) -> bool:
        """The request waits for its grammar, outside the waiting queue."""
        return self.grammar_queue.holds(request_id)

    def poll_tiers(self) -> None:
        """What the KV tiers' workers finished, settled (loaded requests join the scheduler): each step does it,
        and the service between steps while idle."""
        if self.kv_tiers is not None:
            for request in self.kv_tiers.poll():
                self.scheduler.add(request)

    @property
    def waiting_tenants_share(self) -> int:
        """All tenants together may have this many times --max-waiting-seqs waiting (1: one bound for all)."""
        return TENANTS_SHARE if self.config.fair_share else 1

    def queue_full_for(self, tenant: Tenant) -> bool:
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
        """The grammars compiled for this tokenizer (built on first use, with the process that compiles them)."""
        return self.grammar_queue.grammars

    def compile_grammar(self, spec: StructuredOutputsParams, tenant: Tenant = ANONYMOUS_TENANT) -> Future:
        return self.grammars.compile(spec, tenant)

    def close(self) -> None:
        """Let go of what outlives the engine's own objects: the grammar compile process and its thread."""
        self.grammar_queue.close()
        if self.adapter_loads is not None:
            self.adapter_loads.close()
        if self.kv_tiers is not None:
            self.kv_tiers.close()

    def _admit_compiled(self) -> list[StepOutput]:
        """Structured outputs: requests whose grammar is ready join the scheduler's queue, in arrival order;
        those whose grammar failed end with its error (a 400, or a 500 where the fault was the engine's)."""
        ready, failed = self.grammar_queue.take_settled()
        if self.adapter_loads is not None and len(self.adapter_loads):  # so too for adapters' weights
            loaded, not_loaded = self.adapter_loads.take_settled(self.intake.adapters_in_use())
            ready, failed = ready + loaded, failed + not_loaded
        for request in ready:
            self._enqueue(request)
        refused = []
        for request, error in failed:
            for choice in [request, *request.forks]:  # none has started: they wait for the first one's prompt
                self._end(choice, "error")
            code = 400 if isinstance(error, ValueError) else 500
            refused.append(
                StepOutput(request.group_id, [], [], "error", 0, error=str(error), error_code=code)
            )
        return refused

    # -- the step ---------------------------------------------------------------------------------

    def step(self) -> StepResult:
        """Schedule, run the model and sample, let the scheduler book it, propose for the next step."""
        started = time.perf_counter()
        held = len(self.grammar_queue) + (len(self.adapter_loads) if self.adapter_loads is not None else 0)
        result = StepResult(self._admit_compiled() if held else [])
        self.poll_tiers()
        sched = self.scheduler.schedule()
        if self.kv_tiers is not None:
            if not sched.scheduled and self.scheduler.num_unfinished and self.kv_tiers.release_all():
                sched = self.scheduler.schedule()  # loads' pins held the blocks the first in line needs
            self.kv_tiers.release_started()
        if self.cpu_threads is not None and sched.scheduled:
            self.cpu_threads.before_step()
        self.kv_block_seconds.charge(self.scheduler.running)
        now = time.time_ns()
        for request, _ in sched.scheduled:
            if not request.first_scheduled_ns:
                request.first_scheduled_ns = now
                result.queue_times.append(max(0, now - request.arrival_ns) / 1e9)
        if sched.scheduled:
            self._prepare_blocks()
            logits = self.runner.execute(sched.scheduled, self.kv)
            sampled = self.sampling(logits, lambda request: self.scheduler.fork(sched, request))
            news = self.scheduler.update_from_output(sched, sampled.requests, sampled.token_ids)
            now = time.time_ns()
            result.outputs += [
                self._output(new, lp, now) for new, lp in zip(news, sampled.logprobs, strict=True)
            ]
            if self.ngram is not None or self.draft is not None:
                self._propose([new.request for new in news if new.request.finish_reason is None])
        elif len(self.grammar_queue):  # nothing else to do until a grammar is ready: wait for one, briefly
            self.grammar_queue.wait(GRAMMAR_WAIT_S)
        elif self.adapter_loads is not None and len(self.adapter_loads):  # or for an adapter's weights
            self.adapter_loads.wait(GRAMMAR_WAIT_S)
        elif self.kv_tiers is not None and self.kv_tiers.in_flight:  # likewise for blocks the tiers copy
            self.kv_tiers.wait(GRAMMAR_WAIT_S)
        elif self.scheduler.num_unfinished:
            raise RuntimeError("scheduler made no progress with requests waiting")  # admission forbids this
        result.cached, result.evicted = self.kv.pool.drain_events()
        if self.kv_tiers is not None:
            self.kv_tiers.offload(result.cached)
            result.tier_events = self.drain_tier_events()
            result.pull_times = self.kv_tiers.counters.take_pull_seconds()
        if self.cpu_threads is not None and sched.scheduled:
            self.cpu_threads.after_step(time.perf_counter() - started)
        return result

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
            cached_from=request.cached_from,
        )

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

    # -- what it publishes ------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """The engine's numbers now, cheap enough to take every step."""
        scheduler, pool = self.scheduler, self.kv.pool
        waiting = [*scheduler.waiting, *self.grammar_queue.requests, *self._loading()]
        if self.adapter_loads is not None:
            waiting += self.adapter_loads.requests
        return EngineStats(
            running=len(scheduler.running),
            waiting=len(waiting),
            compiling=len(self.grammar_queue),
            waiting_max_tenant=scheduler.waiting.max_per_tenant,
            prefill_tokens=sum(
                max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in [*scheduler.running, *waiting]
            ),
            queue_full=scheduler.queue_full,
            kv_blocks_used=pool.num_used_blocks,
            kv_blocks_total=pool.num_blocks,
            kv_blocks_filled=pool.num_blocks - pool.num_empty_blocks,
            block_size=self.block_size,
            prefix_cache_queried_tokens=scheduler.prefix_cache_queries,
            prefix_cache_hit_tokens=scheduler.prefix_cache_hits,
            preemptions=scheduler.num_preemptions,
            spec_draft_tokens=scheduler.spec_draft_tokens,
            spec_accepted_tokens=scheduler.spec_accepted_tokens,
            block_hash_mismatches=self.intake.block_hash_mismatches,
            structured_output_mask_seconds=self.sampling.mask_seconds,
            **({} if self.kv_tiers is None else self.kv_tiers.stats()),
            **({} if self.adapters is None else self.adapters.residency(self.scheduler.running)),
        )

    @property
    def serves_adapters(self) -> bool:
        """Whether it serves LoRA adapters (--enable-lora)."""
        return self.adapters is not None

    def sync_adapters(self, registry: dict[str, str]) -> bool:
        """Serve the run-time LoRA registry (name -> path); whether what it serves or refuses changed."""
        return self.adapters.sync(registry)

    def adapter_registration(self) -> dict[str, str | int]:
        """What the registration says of its adapters: lora_adapters (name -> the digest their block hashes name),
        lora_refused (name -> the path and why one of the run-time registry is not served) and max_loras; none
        without LoRA."""
        return {} if self.adapters is None else self.adapters.registration(self.config.max_loras)

    def kv_tokens_stored(self) -> int:
        """Tokens whose KV the running requests' blocks hold, a shared block counted once (walks every table)."""
        return self.kv.num_tokens_stored(self.scheduler.running)

    def cached_block_hashes(self) -> list[bytes]:
        """Every block hash in the prefix cache now (the executor index's republish after Redis lost it)."""
        return self.kv.pool.cached_hashes()

    def tier_hashes(self) -> dict[str, list[bytes]]:
        """Every block hash each tier below the pool holds now, by tier name (the republish's, too)."""
        return {} if self.kv_tiers is None else self.kv_tiers.tier_hashes()

    def drain_tier_events(self) -> dict[str, tuple[list[bytes], list[bytes]]]:
        """Each tier's hashes added and removed since the last drain (a step's, or the idle service's)."""
        return {} if self.kv_tiers is None else self.kv_tiers.drain_events()

    def _loading(self) -> list[Request]:
        return [] if self.kv_tiers is None else self.kv_tiers.held_requests()
