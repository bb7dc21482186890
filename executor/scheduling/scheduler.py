"""Continuous batching under one token budget per step: decodes first, then prefill chunks, shared by tenant.

A step has two halves here: schedule() decides what runs, and update_from_output() books what the model made of
it (computed tokens, accepted proposals, full blocks published, finished requests freed). The scheduler is the one
place that moves a request's num_computed_tokens.

Fair share. Every running decode goes first, each step, and a step computes at most max_num_batched_tokens
tokens, decodes included: whatever any tenant prefills, a stream's next token waits one step at most. What the
budget leaves is handed out one prefill chunk at a time, to the tenant with the least service so far
(executor/scheduling/fair_share.py), counting this step's chunks: that tenant's partial prefills first, oldest
first, then its next waiting request. So a tenant's burst of long prompts waits behind itself, and the tenants'
prefill tokens follow their weights while all have work. With fair share off, or with one tenant, the order is
first come first served: running prefills, oldest first, then the waiting requests in their order.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from executor.kv.cache_manager import KVCacheManager
from executor.request import Request, RequestStatus
from executor.scheduling.fair_share import VirtualTokenCounter, service
from executor.scheduling.waiting_queue import WaitingQueue
from shared.tenant import Tenant


@dataclass(slots=True)
class SchedulerOutput:
    # (request, number of its tokens to compute this step), in batch order
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


@dataclass(slots=True)
class NewTokens:
    """What a step added to one request: the tokens it kept, and how its proposals fared."""

    request: Request
    token_ids: list[int]  # accepted proposals and one more, cut at a stop
    num_proposed: int = 0  # proposals this step verified
    num_accepted: int = 0  # of which the target accepted


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        max_waiting_seqs: int | None = None,
        max_waiting_tokens: int | None = None,
        fair_share: bool = True,
        max_loras: int = 1,
    ) -> None:
        self.kv = kv
        self.max_loras = max_loras  # distinct LoRA adapters among running requests (executor/lora/)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        # max_waiting_*: one tenant's places in the queue; None: no bound (the offline API queues everything)
        self.waiting = WaitingQueue(fair_share, max_waiting_seqs, max_waiting_tokens)
        self.running: list[Request] = []  # oldest first; the newest is preempted first
        self.counter = VirtualTokenCounter()  # service per tenant (tenants as the waiting queue knows them)
        self._charged: dict[Request, float] = {}  # what this step has charged each request's tenant so far
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # of which were found
        self.spec_draft_tokens = 0  # proposals verified, all requests
        self.spec_accepted_tokens = 0  # of which accepted

    def add(self, request: Request) -> None:
        request.queued_ns = time.time_ns()
        self.counter.join(self.waiting.tenant_of(request))
        self.waiting.add(request)

    def finish(self, request: Request, reason: str) -> None:
        """End a request (stopped, or aborted by its owner): out of the queues, its blocks given back."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finished_ns = time.time_ns()
        held = True
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        else:
            held = False  # a choice still to fork, or a request that never got here (its grammar failed)
        if held:
            self.counter.leave(self.waiting.tenant_of(request))
        self.kv.free(request)

    @property
    def queue_full(self) -> bool:
        """Whether the waiting queue is at its bound, all tenants' places taken."""
        return self.waiting.full

    def queue_full_for(self, tenant: Tenant) -> bool:
        """Whether a new request of tenant's would find no place in the waiting queue: it would wait for a step
        that is not near, so the service refuses it (the gateway sends it where it can start sooner, or holds it)."""
        return self.waiting.full_for(tenant)

    def unstarted_since(self, before_ns: int) -> list[Request]:
        """Waiting requests that joined the queue before before_ns and were never scheduled (no output, no KV)."""
        return [r for r in self.waiting if not r.first_scheduled_ns and r.queued_ns < before_ns]

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._charged = {}
        budget = self.max_num_batched_tokens
        prefills: dict[Tenant, deque[Request]] = {}  # running prefills by tenant, oldest first
        for request in self.running:
            if request.num_tokens - request.num_computed_tokens > 1:
                prefills.setdefault(self.waiting.tenant_of(request), deque()).append(request)
        for request in [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]:
            if budget == 0:
                break
            if request.status is RequestStatus.RUNNING:  # else preempted earlier in this loop
                budget = self._schedule_running(request, out, budget)
        admitting = True  # until a waiting request does not fit; never in a step that preempted
        # waiting requests of adapters that find no slot this step (max_loras): the requests behind them, of the
        # base model or of adapters already running, start meanwhile, as vLLM's scheduler lets them
        passed: set[Request] = set()
        while budget > 0:
            request = self._next_prefill(prefills, admitting and not out.preempted, budget, passed)
            if request is None:
                break
            if request.status is RequestStatus.RUNNING:
                prefills[self.waiting.tenant_of(request)].popleft()
                budget = self._schedule_running(request, out, budget)
                continue
            if request.adapter is not None and self._adapter_slots_full(request.adapter.name):
                passed.add(request)
                continue
            num_new = self._admit(request, out, budget)
            if num_new is None:
                admitting = False
            else:
                budget -= num_new
        return out

    def _next_prefill(
        self,
        prefills: dict[Tenant, deque[Request]],
        admitting: bool,
        budget: int,
        passed: set[Request],
    ) -> Request | None:
        """The request whose prefill chunk goes next, None when no tenant has one to give (or may start one): the
        next of the tenant whose counter would be lowest once charged for the chunk, a tenant's partial prefills
        before its waiting requests. Ranked by the counter after the chunk (weighted fair queuing's finish time),
        not before it: a chunk may be a whole step's budget, and an arriving tenant is lifted to the lowest
        counter, so with the counter before it a tie would hand a burst one more step while a new tenant's short
        prompt waited. Waiting requests passed over this step are not offered again."""
        nexts: dict[Tenant, Request] = {}
        for tenant, queue in prefills.items():
            while queue and queue[0].status is not RequestStatus.RUNNING:
                queue.popleft()  # preempted earlier in this step
            if queue:
                nexts[tenant] = queue[0]
        if admitting:
            for tenant in self.waiting.tenants():
                if tenant not in nexts and (first := self.waiting.first(tenant, passed)) is not None:
                    nexts[tenant] = first

        def finish_time(tenant: Tenant) -> tuple[float, int]:
            request = nexts[tenant]
            # a waiting request's cached prefix is looked up only if it starts: ranked as if none were cached
            chunk = min(request.num_tokens - request.num_computed_tokens, budget)
            return self.counter.of(tenant) + service(chunk) / request.tenant.weight, request.arrival_ns

        return nexts[min(nexts, key=finish_time)] if nexts else None

    def _schedule_running(self, request: Request, out: SchedulerOutput, budget: int) -> int:
        """Schedule a running request's next tokens (a decode and its proposals, or a prefill chunk) within the
        budget, preempting running requests (_preemption_victim) while its blocks do not fit; the budget left."""
        # a decode also verifies its proposals (spec tokens): as many as the budget leaves room for
        num_new = min(request.num_tokens_with_spec - request.num_computed_tokens, budget)
        request.truncate_spec_tokens(max(0, request.num_computed_tokens + num_new - request.num_tokens))
        if request.spec_token_ids and not self.kv.allocate(request, num_new):
            # proposals never preempt anyone: drop them and schedule the plain decode
            request.set_spec_tokens([])
            num_new = request.num_tokens - request.num_computed_tokens
        while not self.kv.allocate(request, num_new, reserve=len(request.forks)):
            victim = self._preemption_victim()
            self._preempt(victim, out)
            budget = self.max_num_batched_tokens - out.num_tokens  # the victim's tokens come back
            if victim is request:
                break
        if request.status is RequestStatus.RUNNING:
            out.scheduled.append((request, num_new))
            self._charge(request, service(num_new))
            budget -= num_new
        return budget

    def _adapter_slots_full(self, name: str) -> bool:
        """Whether starting a request of adapter name would run more distinct adapters than max_loras."""
        running = {r.adapter.name for r in self.running if r.adapter is not None}
        return name not in running and len(running) >= self.max_loras

    def _preemption_victim(self) -> Request:
        """The running request to preempt for blocks: the newest of the tenant whose running requests hold the
        most blocks for its weight, so a tenant's growth takes from its own newest work before another tenant's
        (with one tenant, or fair share off, the newest of all)."""
        held: dict[Tenant, float] = {}  # newest first: on a tie, the tenant of the newest request
        for r in reversed(self.running):
            tenant = self.waiting.tenant_of(r)
            held[tenant] = held.get(tenant, 0.0) + self.kv.num_blocks(r) / r.tenant.weight
        if len(held) == 1:
            return self.running[-1]
        tenant = max(held, key=held.get)
        return next(r for r in reversed(self.running) if self.waiting.tenant_of(r) == tenant)

    def _admit(self, request: Request, out: SchedulerOutput, budget: int) -> int | None:
        """Start a waiting request with what of its prompt the budget allows: the tokens scheduled, or None when
        it does not fit (max_num_seqs, blocks, or a whole prompt without chunked prefill)."""
        if len(self.running) + request.group_size > self.max_num_seqs:
            return None
        cached = self.kv.find_cached_prefix(request)
        num_cached = cached.num_tokens
        num_new = request.num_tokens - num_cached
        if num_new > budget and not self.enable_chunked_prefill:
            return None
        num_new = min(num_new, budget)
        if not self.kv.allocate(request, num_new, cached, reserve=len(request.forks)):
            return None
        self.waiting.remove(request)
        request.num_computed_tokens = num_cached
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached
            self.prefix_cache_queries += request.num_prompt_tokens
            self.prefix_cache_hits += request.num_cached_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        out.scheduled.append((request, num_new))
        self._charge(request, service(num_new, num_cached))
        return num_new

    def _charge(self, request: Request, tokens: float) -> None:
        self.counter.charge(self.waiting.tenant_of(request), request.tenant.weight, tokens)
        self._charged[request] = self._charged.get(request, 0.0) + tokens

    def fork(self, out: SchedulerOutput, parent: Request) -> list[Request]:
        """Parallel sampling: the step out scheduled has just prefilled parent's prompt, so the choices waiting
        in its forks start now, sharing its blocks, as if this step had computed their prompt too (their first
        tokens come from the same logits). They run from here on as requests of their own."""
        children = [
            c for c in parent.forks if c.status is not RequestStatus.FINISHED
        ]  # not aborted meanwhile
        parent.forks = []
        num_new = next(n for r, n in out.scheduled if r is parent)
        for child in children:
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            child.num_draft_computed = parent.num_draft_computed
            child.first_scheduled_ns = parent.first_scheduled_ns
            child.status = RequestStatus.RUNNING
            self.kv.fork(parent, child)
            self.counter.join(self.waiting.tenant_of(child))
            self.running.append(child)
            out.scheduled.append((child, num_new))
        return children

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Recompute later: drop its KV (the prefix cache keeps most of it) and requeue it first in line."""
        self.running.remove(request)
        self.kv.free(request)
        request.set_spec_tokens([])  # proposed for a context it no longer has in the cache
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = request.num_draft_computed = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.requeue(request)
        refund = self._charged.pop(request, 0.0)  # scheduled earlier in this step: it computes none of it now
        if refund:
            self.counter.charge(self.waiting.tenant_of(request), request.tenant.weight, -refund)
        out.preempted.append(request)
        out.scheduled = [(r, n) for r, n in out.scheduled if r is not request]

    def update_from_output(
        self, out: SchedulerOutput, sampled: list[Request], token_ids: list[list[int]]
    ) -> list[NewTokens]:
        """Book a step the model ran: out's tokens now have KV; each sampled request gets its new tokens
        (token_ids, aligned with sampled), its rejected proposals rolled back. Full blocks are published and
        finished requests freed; what each sampled request kept comes back, in order."""
        for request, n in out.scheduled:
            request.num_computed_tokens += n
        news = [self._append(request, ids) for request, ids in zip(sampled, token_ids, strict=True)]
        for request, _ in out.scheduled:
            self.kv.cache_full_blocks(request)
        for new in news:
            if new.request.finish_reason is not None:
                self.finish(new.request, new.request.finish_reason)
        return news

    def _append(self, request: Request, token_ids: list[int]) -> NewTokens:
        """Append the step's tokens up to a stop; give back the KV positions of rejected proposals."""
        new = NewTokens(request, token_ids, len(request.spec_token_ids), len(token_ids) - 1)
        if request.params.max_tokens == 0:  # it only scored its prompt: the token sampled is not output
            del token_ids[:]
            request.finish_reason = "length"
            return new
        if new.num_proposed:
            request.num_draft_tokens += new.num_proposed
            request.num_accepted_tokens += new.num_accepted
            self.spec_draft_tokens += new.num_proposed
            self.spec_accepted_tokens += new.num_accepted
            # the draft wrote KV for all its proposals but the last while proposing
            request.num_draft_computed += min(new.num_accepted, new.num_proposed - 1)
            # the rejected positions' KV is garbage: forget it (later tokens overwrite those slots)
            request.num_computed_tokens -= new.num_proposed - new.num_accepted
            request.set_spec_tokens([])
        reason, kept = None, 0
        while reason is None and kept < len(token_ids):  # a stop inside an accepted run ends it there
            request.append_token(token_ids[kept])
            kept += 1
            reason = request.check_stop(self.max_model_len)
            if request.grammar is not None and request.grammar.accept(token_ids[kept - 1]):
                reason = "stop"  # structured outputs: the grammar is complete
        del token_ids[kept:]
        # all but the newest token have KV (fewer when a stop cut the run short)
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        request.finish_reason = reason
        return new
