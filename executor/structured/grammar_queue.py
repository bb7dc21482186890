"""Structured outputs: the requests whose grammar still compiles, held here rather than in the scheduler's bounded
queue until it is ready, and a bounded number of them (one tenant --max-waiting-seqs, all tenants together
TENANTS_SHARE times that, as in the waiting queue). The grammars themselves (compiled for this tokenizer, with the
process that compiles them) are built on first use."""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait

from executor.engine_busy import EngineBusy
from executor.engine_config import EngineConfig
from executor.request import Request
from executor.scheduling.waiting_queue import TENANTS_SHARE
from executor.structured.grammars import Grammars
from shared.structured_outputs import StructuredOutputsParams
from shared.tenant import Tenant


class GrammarQueue:
    def __init__(
        self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int], config: EngineConfig
    ) -> None:
        self._grammar_args = (tokenizer, vocab_size, eos_token_ids, config.grammar_compile_timeout)
        self._fast_budget_s = config.grammar_fast_budget
        self._grammars: Grammars | None = None
        self.max_waiting_seqs = config.max_waiting_seqs
        self.requests: list[Request] = []  # in arrival order

    @property
    def grammars(self) -> Grammars:
        if self._grammars is None:
            self._grammars = Grammars(*self._grammar_args, fast_budget_s=self._fast_budget_s)
        return self._grammars

    def __len__(self) -> int:
        return len(self.requests)

    def holds(self, request_id: str) -> bool:
        return any(r.request_id == request_id for r in self.requests)

    def compiled(self, spec: StructuredOutputsParams, tenant: Tenant) -> Future:
        """The tenant's grammar for spec, compiled or compiling. Raises the ValueError of one known to fail, and
        EngineBusy for one that would wait for a compile without room to."""
        known = self.grammars.lookup(spec, tenant)
        if known is None or not known.done():
            self._check_room(tenant)
        compiled = self.grammars.compile(spec, tenant)
        if (
            compiled.done() and compiled.exception() is not None
        ):  # refused before, so the spec's own: a ValueError
            raise ValueError(str(compiled.exception()))
        return compiled

    def _check_room(self, tenant: Tenant) -> None:
        own = sum(1 for r in self.requests if r.tenant == tenant)
        if own >= self.max_waiting_seqs:
            raise EngineBusy(
                f"executor busy: {own} of this tenant's requests already wait for their grammars to compile"
            )
        if len(self.requests) >= TENANTS_SHARE * self.max_waiting_seqs:
            raise EngineBusy(
                f"executor busy: {len(self.requests)} requests already wait for their grammars to compile"
            )

    def hold(self, request: Request) -> None:
        self.requests.append(request)

    def drop(self, request: Request) -> None:
        """A request no longer waits for its grammar: the compile is dropped unless another request waits too."""
        if request not in self.requests:
            return
        self.requests.remove(request)
        future = request.grammar.future
        if not any(r.grammar.future is future for r in self.requests):
            self.grammars.cancel(future)

    def take_settled(self) -> tuple[list[Request], list[tuple[Request, BaseException]]]:
        """The requests whose grammar is ready, in arrival order, and those whose grammar failed, with why;
        both leave the queue."""
        ready, failed, still = [], [], []
        for request in self.requests:
            error = request.grammar.error
            if request.grammar.ready:
                ready.append(request)
            elif error is not None:
                failed.append((request, error))
            else:
                still.append(request)
        self.requests = still
        return ready, failed

    def wait(self, timeout_s: float) -> None:
        """Until a grammar is ready, briefly: nothing else to do meanwhile."""
        wait([r.grammar.future for r in self.requests], timeout=timeout_s, return_when=FIRST_COMPLETED)

    def close(self) -> None:
        """Let go of the grammar compile process and its thread."""
        if self._grammars is not None:
            self._grammars.close()
