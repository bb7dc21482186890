"""Constrained decoding: each structured request's output held to its grammar by a token bitmask per step.

The grammar library is xgrammar (vLLM's and SGLang's default): at the default model's 49k vocabulary it fills a
mask in ~5 us a token, several times faster than llguidance. A grammar's compile time is the client's to choose
(a regex's grows with the square of its length), so no compile may stall anyone. Each is tried in a compile process
(executor/structured/grammar_worker.py) and, once it has compiled there, compiled again here, in two lanes with a
thread and a process each: the fast lane tries every spec first under --grammar-fast-budget (hundreds of
milliseconds), so a plain schema never waits behind a long compile; only a spec that outgrows the budget goes on to
the slow lane, whose compiles may take --grammar-compile-timeout. In each lane specs take turns by tenant
(executor/scheduling/tenant_turns.py). Compiled grammars are kept per tenant and spec in a bounded LRU: another
tenant's compile is never a hit, so timing tells no tenant what another asked. A refused spec (the library's
error, or past the deadline) is a ValueError naming structured_outputs.<kind>, remembered per tenant (its cache
salt) and spec for the grammars' lifetime: asked again, it is refused at once with the same error, not compiled.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field

from executor.scheduling.tenant_turns import TenantTurns
from executor.structured.grammar_worker import (
    CompileTimeout,
    ForkServer,
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
# refused specs remembered, all tenants together, least recently asked forgotten first: a digest and the message
# each, apart from the grammars so that no flood of good specs makes a refused one compile again
MAX_REMEMBERED_REFUSALS = 4096
MAX_REFUSAL_CHARS = 2048  # of a refusal's message (the library's may quote the spec): kept and sent alike
FAST_BUDGET_S = 0.3  # the fast lane's compile budget (--grammar-fast-budget)

GrammarKey = tuple[Tenant, str, str]  # (tenant, kind, the spec's text)


def _key(spec: StructuredOutputsParams, tenant: Tenant) -> GrammarKey:
    return (tenant, spec.kind, json.dumps(getattr(spec, spec.kind), ensure_ascii=False))


def _digest(key: GrammarKey) -> bytes:
    """The key, for the refusals: a fixed size whatever the spec's, the tenant by name and cache salt."""
    tenant, kind, text = key
    return hashlib.sha256(json.dumps([tenant.name, tenant.cache_salt, kind, text]).encode()).digest()


def _refused(message: str) -> Future:
    future: Future = Future()
    future.set_exception(ValueError(message))
    return future


@dataclass(slots=True, eq=False)
class _Compile:
    """One tenant's spec to compile, and the future its requests wait on."""

    key: GrammarKey
    spec: StructuredOutputsParams
    future: Future = field(default_factory=Future)
    lane: _Lane | None = None  # the lane whose queue holds it

    @property
    def tenant(self) -> Tenant:
        return self.key[0]


@dataclass(slots=True, eq=False)
class _Lane:
    """A compile thread with its own process, in-process compiler and queue (tenants in turns)."""

    name: str
    fast: bool  # its budget is --grammar-fast-budget (else --grammar-compile-timeout)
    worker: GrammarWorker
    compiler: object  # xgr.GrammarCompiler, for the compile here once the process has shown it fits
    pending: TenantTurns[_Compile] = field(default_factory=TenantTurns)
    thread: threading.Thread | None = None


class Grammars:
    """The compiled grammars of one model's tokenizer, per tenant. The tokenizer info is built once, here; the
    fast and the slow lane's threads, at the compile priority, each take their specs one at a time, tenants in
    turn: the lane's process compiles it under the lane's budget (a fresh process replaces one that overran it or
    died), then the lane's thread compiles it for this process. A spec past the fast budget goes to the slow lane;
    past the slow lane's deadline, it is refused."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        timeout_s: float,
        max_cached: int = MAX_CACHED_GRAMMARS,
        fast_budget_s: float = FAST_BUDGET_S,
        max_refusals: int = MAX_REMEMBERED_REFUSALS,
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
        self.fast_budget_s = fast_budget_s
        self.max_cached = max_cached
        self.max_refusals = max_refusals
        self.num_compiled = 0  # compilations queued (cache misses)
        self.num_slow = 0  # of those, compiles that outgrew the fast budget
        self._server = ForkServer(self.tokenizer_info.serialize_json(), compile_niceness())
        self._cache: OrderedDict[GrammarKey, Future] = OrderedDict()
        self._refusals: OrderedDict[bytes, str] = OrderedDict()  # digest of the key -> the error's message
        self._queued: dict[Future, _Compile] = {}  # the pending ones, by the future their requests hold
        self._changed = threading.Condition()
        self._closed = False
        self.fast, self.slow = (
            _Lane(name, name == "fast", GrammarWorker(self._server), self._compiler())
            for name in ("fast", "slow")
        )
        for lane in (self.fast, self.slow):
            lane.thread = threading.Thread(
                target=self._compile_in_turn, args=(lane,), name=f"grammar-{lane.name}", daemon=True
            )
            lane.thread.start()
        # an orderly end at interpreter exit too (else the pipe's closing or the parent-death signal ends it)
        atexit.register(self.close)

    def _compiler(self):
        """One for each lane's thread: a compiler is not shared between threads."""
        return xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)

    @property
    def worker_pids(self) -> tuple[int | None, int | None]:
        """The fast and the slow lane's compile processes' ids; None where there is none."""
        return self.fast.worker.pid, self.slow.worker.pid

    @property
    def server_pid(self) -> int | None:
        """The fork server's id; None while there is none."""
        return self._server.pid

    def lookup(self, spec: StructuredOutputsParams, tenant: Tenant = ANONYMOUS_TENANT) -> Future | None:
        """The tenant's compile of spec, cached, refused or under way; None when it would be a new one."""
        key = _key(spec, tenant)
        with self._changed:
            refused = self._refusals.get(_digest(key))
            return _refused(refused) if refused is not None else self._cache.get(key)

    def compile(self, spec: StructuredOutputsParams, tenant: Tenant = ANONYMOUS_TENANT) -> Future:
        """The compiled grammar, or its ValueError, once ready; the tenant's spec asked before shares the first
        one's future (another tenant's never does), and one refused before is refused again at once."""
        key = _key(spec, tenant)
        with self._changed:
            if self._closed:
                raise RuntimeError("structured outputs: the grammar compiler is closed")
            digest = _digest(key)
            refused = self._refusals.get(digest)
            if refused is not None:
                self._refusals.move_to_end(digest)
                return _refused(refused)
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            job = _Compile(key, spec)
            self._cache[key] = job.future
            self._queue(job, self.fast)
            self.num_compiled += 1
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)  # requests still compiling it hold their own reference
        return job.future

    def _queue(self, job: _Compile, lane: _Lane) -> None:
        """Into the lane's turns (the lock held)."""
        job.lane = lane
        self._queued[job.future] = job
        lane.pending.push(job.tenant, job)
        self._changed.notify_all()

    def cancel(self, future: Future) -> None:
        """No request waits for this compile any more: dropped if it is queued (one under way ends by itself,
        within its lane's budget)."""
        with self._changed:
            job = self._queued.pop(future, None)
            if job is None:
                return
            job.lane.pending.remove(job.tenant, job)
            self._forget(job)
            future.cancel()

    def close(self) -> None:
        """Stop compiling: queued compiles are cancelled, the compile processes are killed and reaped."""
        with self._changed:
            if self._closed:
                return
            self._closed = True
            for lane in (self.fast, self.slow):
                for job in lane.pending.clear():
                    job.future.cancel()
            self._queued.clear()
            self._changed.notify_all()
        atexit.unregister(self.close)
        for lane in (self.fast, self.slow):
            lane.worker.kill()  # a compile under way ends now
        for lane in (self.fast, self.slow):
            lane.thread.join()
        self._server.stop()

    def _forget(self, job: _Compile) -> None:
        """Out of the cache (the lock held): the spec compiles afresh when asked again."""
        if self._cache.get(job.key) is job.future:
            del self._cache[job.key]

    def _refuse(self, job: _Compile, message: str) -> None:
        """The spec's own fault: remembered, so that it is never compiled again, and its requests told why."""
        message = message[:MAX_REFUSAL_CHARS]
        with self._changed:
            self._forget(job)
            self._refusals[_digest(job.key)] = message
            while len(self._refusals) > self.max_refusals:
                self._refusals.popitem(last=False)
        job.future.set_exception(ValueError(message))

    def _compile_in_turn(self, lane: _Lane) -> None:
        """A lane's thread: its compile process started at once, then the next tenant's next spec."""
        lower_thread_priority(self._server.niceness)  # before the processes start: they inherit it on Linux
        self._start_worker(lane)
        while True:
            with self._changed:
                while not lane.pending and not self._closed:
                    self._changed.wait()
                if self._closed:
                    break
                job = lane.pending.pop()
                del self._queued[job.future]
                if job.future.cancelled():
                    continue
            self._run(lane, job)
        lane.worker.stop()

    def _start_worker(self, lane: _Lane) -> None:
        """A process ready before the lane's next compile needs it; a failure here is logged, and the next
        compile tries again (and fails with it)."""
        try:
            lane.worker.start()
        except WorkerFailed as error:
            if not self._closed:
                log.error("structured outputs: %s", error)

    def _run(self, lane: _Lane, job: _Compile) -> None:
        kind = job.spec.kind
        budget_s = min(self.fast_budget_s, self.timeout_s) if lane.fast else self.timeout_s
        try:
            lane.worker.try_compile(job.spec, budget_s)
            job.future.set_result(compile_spec(lane.compiler, job.spec))  # shown to fit the budget
            return
        except ValueError as error:  # the library's word on the spec
            self._refuse(job, str(error))
            return
        except CompileTimeout:
            if not self._closed:  # its process was killed: a fresh one (a fork, milliseconds) for the next
                self._start_worker(lane)
            if lane.fast and budget_s < self.timeout_s:  # it may yet fit the deadline: the slow lane's turn
                with self._changed:
                    if not self._closed:
                        self.num_slow += 1
                        self._queue(job, self.slow)
                        return
                failure: Exception = RuntimeError("structured outputs: the grammar compiler is closed")
            else:
                log.info(
                    "structured outputs: a %s compile ran past %g s; its process killed", kind, self.timeout_s
                )
                self._refuse(
                    job,
                    f"structured_outputs.{kind}: compiling it took longer than the {self.timeout_s:g} s limit "
                    "(--grammar-compile-timeout)",
                )
                return
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
            self._start_worker(lane)  # dead: a fresh one for the specs still queued
