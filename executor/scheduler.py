"""Continuous batching under one token budget per step: decodes first, then prefill chunks."""

from __future__ import annotations

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


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        max_waiting_seqs: int | None = None,
        max_waiting_tokens: int | None = None,
    ) -> None:
        self.kv = kv
        self.max_waiting_seqs = max_waiting_seqs  # None: no bound (the offline API queues everything)
        self.max_waiting_tokens = max_waiting_tokens
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # oldest first; the newest is preempted first
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # of which were found

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a finished or aborted request out of the queues and give back its blocks."""
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
        """Waiting requests that arrived before before_ns and were never scheduled (no output, no KV)."""
        return [r for r in self.waiting if not r.first_scheduled_ns and r.arrival_ns < before_ns]

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
            while not self.kv.allocate(request, num_new):
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
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if request.grammar is not None and not request.grammar.ready:
                continue  # structured outputs: its grammar is still compiling; the ones behind it may start
            cached = self.kv.find_cached_prefix(request)
            num_new = request.num_tokens - len(cached) * self.kv.block_size
            if num_new > budget and not self.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if not self.kv.allocate(request, num_new, cached):
                break
            self.waiting.remove(request)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = len(cached) * self.kv.block_size
                self.prefix_cache_queries += request.num_prompt_tokens
                self.prefix_cache_hits += request.num_cached_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append((request, num_new))
            budget -= num_new

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
