"""Continuous batching under one token budget per step: decodes first, then prefill chunks.

A step has two halves here: schedule() decides what runs, and update_from_output() books what the model made of
it (computed tokens, accepted proposals, full blocks published, finished requests freed). The scheduler is the one
place that moves a request's num_computed_tokens.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from executor.kv_cache_manager import KVCacheManager
from executor.request import Request, RequestStatus


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
    ) -> None:
        self.kv = kv
        self.max_waiting_seqs = max_waiting_seqs  # None: no bound (the offline API queues everything)
        self.max_waiting_tokens = max_waiting_tokens
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # oldest first; the newest is preempted first
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # of which were found
        self.spec_draft_tokens = 0  # proposals verified, all requests
        self.spec_accepted_tokens = 0  # of which accepted

    def add(self, request: Request) -> None:
        request.queued_ns = time.time_ns()
        self.waiting.append(request)

    def finish(self, request: Request, reason: str) -> None:
        """End a request (stopped, or aborted by its owner): out of the queues, its blocks given back."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finished_ns = time.time_ns()
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)

    @property
    def queue_full(self) -> bool:
        """Whether the waiting queue is at its bound: a new request would wait here for a step that is not
        near, so the service refuses it (the gateway sends it where it can start sooner, or holds it)."""
        if self.max_waiting_seqs is not None and len(self.waiting) >= self.max_waiting_seqs:
            return True
        if self.max_waiting_tokens is None or not self.waiting:
            return False
        to_prefill = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        return to_prefill >= self.max_waiting_tokens

    def unstarted_since(self, before_ns: int) -> list[Request]:
        """Waiting requests that joined the queue before before_ns and were never scheduled (no output, no KV)."""
        return [r for r in self.waiting if not r.first_scheduled_ns and r.queued_ns < before_ns]

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for request in decodes + prefills:
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            # a decode also verifies its proposals (spec tokens): as many as the budget leaves room for
            num_new = min(request.num_tokens_with_spec - request.num_computed_tokens, budget)
            if num_new == 0:
                break
            request.truncate_spec_tokens(max(0, request.num_computed_tokens + num_new - request.num_tokens))
            if request.spec_token_ids and not self.kv.allocate(request, num_new):
                # proposals never preempt anyone: drop them and schedule the plain decode
                request.set_spec_tokens([])
                num_new = request.num_tokens - request.num_computed_tokens
            while not self.kv.allocate(request, num_new, reserve=len(request.forks)):
                victim = self.running[-1]
                self._preempt(victim, out)
                budget = self.max_num_batched_tokens - out.num_tokens  # the victim's tokens come back
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                out.scheduled.append((request, num_new))
                budget -= num_new
        if not out.preempted:
            self._admit(out, budget)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        for request in list(self.waiting):
            if budget <= 0 or len(self.running) + request.group_size > self.max_num_seqs:
                break
            cached = self.kv.find_cached_prefix(request)
            num_new = request.num_tokens - len(cached) * self.kv.block_size
            if num_new > budget and not self.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if not self.kv.allocate(request, num_new, cached, reserve=len(request.forks)):
                break
            self.waiting.remove(request)
            request.num_computed_tokens = len(cached) * self.kv.block_size
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = len(cached) * self.kv.block_size
                self.prefix_cache_queries += request.num_prompt_tokens
                self.prefix_cache_hits += request.num_cached_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append((request, num_new))
            budget -= num_new

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
        self.waiting.appendleft(request)
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
