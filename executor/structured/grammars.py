"""Constrained decoding: each structured request's output held to its grammar by a token bitmask per step.

The grammar library is xgrammar (vLLM's and SGLang's default): at the default model's 49k vocabulary it fills a
mask in ~5 us a token, several times faster than llguidance. A grammar's compile time is the client's to choose
(a regex's grows with the square of its length), so no compile may stall anyone: each is tried first in a worker
process under --grammar-compile-timeout (executor/structured/grammar_worker.py), which fails only that request,
and one that fits is compiled again here, on the compile thread. Specs take turns by tenant
(executor/scheduling/tenant_turns.py). Compiled grammars are kept per tenant and spec in a bounded LRU: another
tenant's compile is never a hit, so timing tells no tenant what another asked. A failed compile is a ValueError
naming structured_outputs.<kind>.

Rows without a grammar cost nothing: no mask exists when no row of the batch is constrained. The matcher advances
only with emitted tokens, which survive preemption, so recompute needs nothing from here. Speculation: each
verified position gets the mask of the state after the proposals before it (the matcher rolled back afterwards),
so a proposal the grammar refuses is always rejected; one-hot proposals (n-gram, greedy draft) are also cut there
before the step, which saves their verification.
"""

from __future__ import annotations

import atexit
import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from executor.scheduling.tenant_turns import TenantTurns
from executor.structured.grammar_worker import (
    CompileTimeout,
    GrammarWorker,
    WorkerFailed,
    compile_niceness,
    lower_thread_priority,
)
from shared.structured_outputs import StructuredOutputsParams
from shared.tenant import ANONYMOUS_TENANT, Tenant

try:
    import xgrammar as xgr

    from executor.structured.grammar_compile import compile_spec
except ImportError as error:  # an executor serves without it (the GPU image has none): Grammars says why
    xgr = compile_spec = None
    _library_missing: ImportError | None = error
else:
    _library_missing = None

log = logging.getLogger("kvserve.structured_output")

MAX_CACHED_GRAMMARS = 256  # compiled grammars kept, all tenants together, least recently used dropped first

GrammarKey = tuple[Tenant, str, str]  # (tenant, kind, the spec's text)


def _key(spec: StructuredOutputsParams, tenant: Tenant) -> GrammarKey:
    return (tenant, spec.kind, json.dumps(getattr(spec, spec.kind), ensure_ascii=False))


@dataclass(slots=True, eq=False)
class _Compile:
    """One tenant's spec to compile, and the future its requests wait on."""

    key: GrammarKey
    spec: StructuredOutputsParams
    future: Future = field(default_factory=Future)

    @property
    def tenant(self) -> Tenant:
        return self.key[0]


class Grammars:
    """The compiled grammars of one model's tokenizer, per tenant. The tokenizer info is built once, here; a
    thread at the compile priority takes the specs one at a time, tenants in turn: the worker process compiles
    each under the deadline (a fresh process replaces one that overran it or died), then the thread compiles it
    for this process."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        timeout_s: float,
        max_cached: int = MAX_CACHED_GRAMMARS,
    ) -> None:
        if _library_missing is not None:
            raise ValueError(
                "structured_outputs: this executor cannot enforce them: its grammar library is missing "
                f"({_library_missing}; pip install xgrammar)"
            )
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(eos_token_ids)
        )
        self.timeout_s = timeout_s
        self.max_cached = max_cached
        self.num_compiled = 0  # compilations queued (cache misses)
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)
        self._worker = GrammarWorker(self.tokenizer_info.serialize_json(), compile_niceness())
        self._cache: OrderedDict[GrammarKey, Future] = OrderedDict()
        self._pending: TenantTurns[_Compile] = TenantTurns()
        self._queued: dict[Future, _Compile] = {}  # the pending ones, by the future their requests hold
        self._changed = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._compile_in_turn, name="grammar-compile", daemon=True)
        self._thread.start()
        # an orderly end at interpreter exit too (else the pipe's closing or the parent-death signal ends it)
        atexit.register(self.close)

    @property
    def worker_pid(self) -> int | None:
        """The compile process's id; None while there is none."""
        return self._worker.pid

    def lookup(self, spec: StructuredOutputsParams, tenant: Tenant = ANONYMOUS_TENANT) -> Future | None:
        """The tenant's compile of spec, cached or under way; None when it would be a new one."""
        with self._changed:
            return self._cache.get(_key(spec, tenant))

    def compile(self, spec: StructuredOutputsParams, tenant: Tenant = ANONYMOUS_TENANT) -> Future:
        """The compiled grammar, or its ValueError, once ready; the tenant's spec asked before shares the first
        one's future (another tenant's never does)."""
        key = _key(spec, tenant)
        with self._changed:
            if self._closed:
                raise RuntimeError("structured outputs: the grammar compiler is closed")
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            job = _Compile(key, spec)
            self._cache[key] = job.future
            self._queued[job.future] = job
            self._pending.push(job.tenant, job)
            self.num_compiled += 1
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)  # requests still compiling it hold their own reference
            self._changed.notify()
        return job.future

    def cancel(self, future: Future) -> None:
        """No request waits for this compile any more: dropped if it has not started (one under way ends by
        itself, within its deadline)."""
        with self._changed:
            job = self._queued.pop(future, None)
            if job is None:
                return
            self._pending.remove(job.tenant, job)
            self._forget(job)
            future.cancel()

    def close(self) -> None:
        """Stop compiling: queued compiles are cancelled, the worker process is killed and reaped."""
        with self._changed:
            if self._closed:
                return
            self._closed = True
            for job in self._pending.clear():
                job.future.cancel()
            self._queued.clear()
            self._changed.notify_all()
        atexit.unregister(self.close)
        self._worker.kill()  # a compile under way ends now
        self._thread.join()

    def _forget(self, job: _Compile) -> None:
        """Out of the cache (the lock held): the spec compiles afresh when asked again."""
        if self._cache.get(job.key) is job.future:
            del self._cache[job.key]

    def _compile_in_turn(self) -> None:
        """The compile thread: the worker process started at once, then the next tenant's next spec."""
        lower_thread_priority(self._worker.niceness)  # before the worker starts: it inherits it on Linux
        self._start_worker()
        while True:
            with self._changed:
                while not self._pending and not self._closed:
                    self._changed.wait()
                if self._closed:
                    break
                job = self._pending.pop()
                del self._queued[job.future]
                if not job.future.set_running_or_notify_cancel():
                    continue
            self._run(job)
        self._worker.stop()

    def _start_worker(self) -> None:
        """A process ready before the next compile needs it; a failure here is logged, and the next compile
        tries again (and fails with it)."""
        try:
            self._worker.start()
        except WorkerFailed as error:
            if not self._closed:
                log.error("structured outputs: %s", error)

    def _run(self, job: _Compile) -> None:
        kind = job.spec.kind
        try:
            self._worker.try_compile(job.spec, self.timeout_s)
            job.future.set_result(compile_spec(self._compiler, job.spec))  # shown to fit the deadline
            return
        except ValueError as error:  # the library's word on the spec: kept in the cache like a grammar
            job.future.set_exception(error)
            return
        except CompileTimeout:  # under less load it may compile in time: not kept
            log.info(
                "structured outputs: a %s compile ran past %g s; its process killed", kind, self.timeout_s
            )
            failure: Exception = ValueError(
                f"structured_outputs.{kind}: compiling it took longer than the {self.timeout_s:g} s limit "
                "(--grammar-compile-timeout)"
            )
        except WorkerFailed as error:
            if not self._closed:
                log.error("structured outputs: compiling a %s failed: %s", kind, error)
            failure = RuntimeError(f"structured_outputs.{kind}: the grammar compiler failed: {error}")
        except Exception as error:  # a fault of ours, not the client's
            log.exception("structured outputs: compiling a %s failed", kind)
            failure = RuntimeError(f"structured_outputs.{kind}: compiling it failed: {error}")
        with self._changed:
            self._forget(job)
        job.future.set_exception(failure)
        if not self._closed:
            self._start_worker()  # killed or dead: a fresh one for the specs still queued


class RequestGrammar:
    """One request's matcher, built when its grammar is ready; it has accepted exactly the emitted tokens."""

    __slots__ = ("future", "matcher")

    def __init__(self, future: Future) -> None:
        self.future = future
        self.matcher: xgr.GrammarMatcher | None = None

    @property
    def ready(self) -> bool:
        """Compiled: the request may be scheduled."""
        return self.future.done() and self.error is None

    @property
    def error(self) -> BaseException | None:
        """Why it never will be: the compile's exception (a ValueError is the spec's fault), or None."""
        if not self.future.done():
            return None
        if self.future.cancelled():  # only when the grammars closed under it
            return RuntimeError("structured outputs: the grammar's compile was cancelled")
        return self.future.exception()

    def _matcher(self) -> xgr.GrammarMatcher:
        if self.matcher is None:
            self.matcher = xgr.GrammarMatcher(self.future.result())  # rollback is unbounded in xgrammar 0.2
        return self.matcher

    def accept(self, token_id: int) -> bool:
        """Advance with an emitted token; True when the grammar is complete (the request finishes: "stop")."""
        matcher = self._matcher()
        if not matcher.accept_token(token_id):
            raise RuntimeError(f"the grammar refused token {token_id}, which its own mask allowed")
        return matcher.is_terminated()

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many leading proposals the grammar allows (the matcher is left as it was)."""
        matcher, n = self._matcher(), 0
        while n < len(token_ids) and not matcher.is_terminated() and matcher.accept_token(token_ids[n]):
            n += 1
        if n:
            matcher.rollback(n)
        return n

    def fill(self, bitmask: torch.Tensor, row: int, proposals: list[int]) -> None:
        """Rows row .. row + len(proposals): the masks after the emitted tokens and each prefix of proposals.

        A proposal the grammar refuses has probability 0 under its mask, so verification always rejects it:
        the rows past it are never sampled from and stay unmasked."""
        matcher, accepted = self._matcher(), 0
        matcher.fill_next_token_bitmask(bitmask, row)
        for token_id in proposals:
            if not matcher.accept_token(token_id):
                break
            accepted += 1
            matcher.fill_next_token_bitmask(bitmask, row + accepted)
        if accepted:
            matcher.rollback(accepted)


class TokenBitmask:
    """The step's allowed tokens: bit t of a row's words set when token t may come next; rows of requests
    without a grammar are left out of `rows`, so applying it touches only constrained rows."""

    __slots__ = ("bitmask", "rows", "vocab_size")

    def __init__(self, bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
        self.bitmask, self.rows, self.vocab_size = bitmask, rows, vocab_size

    def apply(self, logits: torch.Tensor) -> None:
        """Disallowed tokens' logits to -inf, in place, for every constrained row at once."""
        bitmask = self.bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=self.rows)


def step_bitmask(
    grammars: list[RequestGrammar | None], proposals: list[list[int]], vocab_size: int
) -> TokenBitmask | None:
    """The mask for one step's logits (each request's len(proposals) + 1 rows after one another); None when
    no request of the step is constrained."""
    if all(g is None for g in grammars):
        return None
    num_rows = sum(len(p) + 1 for p in proposals)
    bitmask = xgr.allocate_token_bitmask(num_rows, vocab_size)
    rows, row = [], 0
    for grammar, drafted in zip(grammars, proposals, strict=True):
        if grammar is not None:
            grammar.fill(bitmask, row, drafted)
            rows.extend(range(row, row + len(drafted) + 1))
        row += len(drafted) + 1
    return TokenBitmask(bitmask, rows, vocab_size)
