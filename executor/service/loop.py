"""`kvserve executor`'s service loop: the engine behind a ZeroMQ ROUTER socket, streaming tokens and publishing
itself to Redis (its command line and start-up: executor/cli.py).

One loop: take every waiting message, run one engine step, send each gateway one StepBatch with all of its
requests' new tokens, publish cache changes, load and stats to Redis. Bad input is answered and logged, never
fatal. With tracing on, a request the gateway traced gets its spans when it ends, in the gateway's trace.
What each running request is owed (its updates in order, its end's counts and spans): owned_requests.py.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import zmq

from executor.engine_busy import EngineBusy
from executor.service.gateway_liveness import GatewayLiveness
from executor.service.gateway_outbox import DEFAULT_SNDHWM, GatewayOutbox
from executor.service.index_writer import IndexWriter
from executor.service.owned_requests import Owned, OwnedRequests, log_ids
from executor.step_result import EngineStats, StepOutput, StepResult
from shared import protocol, tracing
from shared.executor_stats import ExecutorStats
from shared.redis_keys import HEARTBEAT_INTERVAL_S
from shared.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine pulls in torch and transformers: `kvserve --help` should not wait for them
    from executor.engine import Engine

log = logging.getLogger("kvserve.executor")

IDLE_POLL_MS = 20
STATS_INTERVAL_S = 0.25  # the stats hash goes out at most this often while the engine is busy
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
# stats counters the service counts (in its requests' books, as vLLM's engine does); EngineStats has the others
COUNTED_HERE = frozenset({"prompt_tokens", "generation_tokens"})


class ExecutorService:
    def __init__(
        self,
        engine: Engine,
        socket: zmq.Socket,
        index: IndexWriter,
        grace_s: float,
        max_unsent: int = DEFAULT_SNDHWM,
    ) -> None:
        self.engine = engine
        self.socket = socket
        self.wire = GatewayOutbox(socket, max_unsent)
        self.index = index
        self.grace_s = grace_s
        self.drain_deadline: float | None = None
        self.gateways = GatewayLiveness()
        # its histograms and token counters are counted here and by the requests' books; the other counters
        # are the engine's
        self.stats = ExecutorStats()
        self.requests = OwnedRequests(index.executor_id, self.stats)
        self.stats_pending = True  # changed since last published
        self.next_stats_at = 0.0

    def drain(self, *_signal_args) -> None:
        """Refuse new work from now on and stop once running requests finish or the grace period ends;
        asked a second time (a second Ctrl-C), stop now."""
        if self.drain_deadline is None:
            log.info(
                "draining: refusing new requests, %d running, grace %.0f s",
                len(self.requests.owners),
                self.grace_s,
            )
            self.drain_deadline = time.monotonic() + self.grace_s
        else:
            log.info("asked again to stop: aborting %d running requests now", len(self.requests.owners))
            self.drain_deadline = time.monotonic()

    def run(self) -> None:
        next_heartbeat = 0.0
        while True:
            busy = self.engine.has_unfinished()
            if self.drain_deadline is not None and (not busy or time.monotonic() >= self.drain_deadline):
                self._abort_all("executor draining: grace period over")
                self._flush()
                self._publish(heartbeat=False, changed=True)
                return
            received = bool(self.socket.poll(0 if busy else IDLE_POLL_MS))
            if received:
                self._receive_all()
            orphaned = self._abort_orphans()
            step = self._step()
            self._flush()
            now = time.monotonic()
            changed = step is not None or received or orphaned  # an abort changes the load without a step
            if changed or now >= next_heartbeat:
                heartbeat = now >= next_heartbeat
                if heartbeat:
                    next_heartbeat = now + HEARTBEAT_INTERVAL_S
                    self._sync_adapters()
                self._publish(heartbeat, changed, step)

    # -- messages in --------------------------------------------------------------------------------

    def _receive_all(self) -> None:
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                log.warning("dropped a message of %d frames (expected identity + payload)", len(frames))
                continue
            identity, payload = frames
            self.gateways.heard(identity, time.monotonic(), heartbeat=False)
            msg = None
            try:
                msg = protocol.decode(payload)
                self._handle(identity, msg)
            except protocol.ProtocolError as error:
                log.warning("bad message from gateway %s: %s", identity.hex(), error)
                if error.request_id is not None:
                    self._send_error(identity, error.request_id, str(error), 400)
            except Exception:  # an internal fault on one message must not stop the others
                request_id = getattr(msg, "request_id", None)
                log.exception(
                    "failed to handle request %s from gateway %s",
                    request_id,
                    identity.hex(),
                    extra=log_ids(request_id, tracing.trace_id(getattr(msg, "traceparent", None))),
                )
                if request_id is not None:
                    self._fail(identity, request_id, "internal error in the executor")

    def _handle(self, identity: bytes, msg: protocol.Message) -> None:
        if isinstance(msg, protocol.GenerateRequest):
            self._generate(identity, msg)
        elif isinstance(msg, protocol.GatewayHeartbeat):
            self.gateways.heard(identity, time.monotonic(), heartbeat=True)
        elif isinstance(msg, protocol.AbortRequest):
            # only the gateway that sent a request may abort it; an unknown id has most likely just finished
            owned = self.requests.get(msg.request_id)
            if owned is None or owned.identity != identity:
                return
            stopped = self.engine.abort(msg.request_id, msg.index)
            if stopped:
                log.debug(
                    "request %s aborted by its gateway (choices %s)",
                    msg.request_id,
                    stopped,
                    extra=log_ids(msg.request_id, owned.trace_id),
                )
                self._finished(msg.request_id, stopped)
        else:
            request_id = getattr(msg, "request_id", None)
            raise protocol.ProtocolError(
                f"an executor accepts generate and abort, not {msg.TYPE}", request_id
            )

    def _generate(self, identity: bytes, msg: protocol.GenerateRequest) -> None:
        trace_id = tracing.trace_id(msg.traceparent)
        if self.drain_deadline is not None:
            self._send_error(identity, msg.request_id, "executor draining", protocol.DRAINING, trace_id)
            return
        # back-pressure: refused before any work, the gateway routes it elsewhere (or holds it)
        if self.engine.queue_full_for(msg.tenant):
            message = "executor busy: its waiting queue is full"
            self._send_error(identity, msg.request_id, message, protocol.BUSY, trace_id)
            return
        try:
            unknown = sorted(set(msg.sampling) - _SAMPLING_FIELDS)
            if unknown:
                raise ValueError(f"sampling: unknown parameter {unknown[0]!r}")
            params = SamplingParams(**msg.sampling)
            choices = self.engine.add_request(
                msg.request_id,
                msg.prompt_token_ids,
                params,
                msg.tenant,
                msg.block_hashes,
                priority=msg.priority,
                kv_peer=msg.kv_peer,
                lora=msg.lora,
            )
        except ValueError as error:
            self._send_error(identity, msg.request_id, str(error), 400, trace_id)
            return
        except EngineBusy as error:  # too many wait for their grammars here: the gateway routes it elsewhere
            self._send_error(identity, msg.request_id, str(error), protocol.BUSY, trace_id)
            return
        parent = tracing.parent_context(msg.traceparent) if tracing.enabled() else None
        owned = Owned(identity, choices, trace_id, parent)
        self.requests.add(msg.request_id, owned)
        if self.engine.is_compiling(msg.request_id):  # it holds none of the queue's places the gateway counts
            self.requests.emit(owned, protocol.accepted(msg.request_id))
        log.debug(
            "request %s received from %s (tenant %s)",
            msg.request_id,
            identity.hex(),
            msg.tenant.name,
            extra=log_ids(msg.request_id, trace_id),
        )

    # -- the step and messages out ------------------------------------------------------------------

    def _step(self) -> StepResult | None:
        """One engine step, its outputs queued for their gateways; None when there was nothing to do."""
        if not self.engine.has_unfinished():
            self.engine.poll_tiers()  # the tiers' copies settle between requests too
            return None
        try:
            step = self.engine.step()
        except Exception:
            log.exception("engine step failed; failing requests %s", ", ".join(self.requests.owners))
            self._fail_all("internal error in the executor's engine step")
            return StepResult()
        for seconds in step.queue_times:
            self.stats.observe_queue_time(seconds)
        for seconds in step.pull_times:
            self.stats.histograms["kv_pull_seconds"].observe(seconds)
        for out in step.outputs:
            self._queue(out)
        if self.index.peer_has_room:  # alone, a request handed back would only lose its place here
            self._hand_back_overdue()
        return step

    def _hand_back_overdue(self) -> None:
        for request_id in self.engine.hand_back_overdue():
            owned = self.requests.release(request_id, "handed back")
            message = f"executor busy: waited {self.engine.config.max_waiting_time:g} s without starting"
            self._send_error(owned.identity, request_id, message, protocol.BUSY, owned.trace_id)

    def _queue(self, out: StepOutput) -> None:
        owned = self.requests.get(out.request_id)
        if owned is None:
            log.error("engine produced output for request %s that no gateway owns", out.request_id)
            return
        if out.error is not None:  # refused after queueing (a grammar that failed to compile)
            self.requests.release(out.request_id, "refused")
            self._send_error(owned.identity, out.request_id, out.error, out.error_code, owned.trace_id)
            return
        self.requests.step_output(owned, out)
        if out.group_finished:
            self.requests.release(out.request_id, out.finish_reason)

    def _finished(self, request_id: str, indexes: list[int]) -> None:
        """Aborted choices end with an update each; the request is released once none of it runs."""
        ended = not self.engine.is_unfinished(request_id)
        self.requests.aborted(request_id, indexes, ended)
        if ended:
            self.requests.release(request_id, "abort")

    def _abort_all(self, why: str, identity: bytes | None = None) -> None:
        """Abort every request, or only those of the gateway with this identity."""
        for request_id, owned in list(self.requests.owners.items()):
            if identity is None or owned.identity == identity:
                log.info(
                    "aborting request %s: %s", request_id, why, extra=log_ids(request_id, owned.trace_id)
                )
                self._finished(request_id, self.engine.abort(request_id))

    def _abort_orphans(self) -> bool:
        """Requests of a gateway that stopped heartbeating: nobody reads them, so their blocks go now."""
        gone = self.gateways.gone(time.monotonic())
        for identity in gone:
            log.warning(
                "gateway %s silent for %.0f s: taking it for gone", identity.hex(), self.gateways.silence_s
            )
            # the aborts still go out: a gateway that was only stalled learns its requests were cut short
            self._abort_all(f"its gateway {identity.hex()} is gone", identity)
        return bool(gone)

    def _fail(self, identity: bytes, request_id: str, message: str) -> None:
        """An internal fault: the request ends with a 500, whatever state the engine has for it is dropped."""
        owned = self.requests.get(request_id)
        trace_id = owned.trace_id if owned is not None else None
        if owned is None or owned.identity == identity:  # never another gateway's request of that id
            try:
                self.engine.abort(request_id)
            except Exception:
                log.exception(
                    "abort of request %s failed too", request_id, extra=log_ids(request_id, trace_id)
                )
            if owned is not None:
                self.requests.release(request_id, "error")
        self._send_error(identity, request_id, message, 500, trace_id)

    def _fail_all(self, message: str) -> None:
        for request_id, owned in list(self.requests.owners.items()):
            self._fail(owned.identity, request_id, message)

    def _flush(self) -> None:
        """One StepBatch per gateway holding all of its requests' updates, after what still waits for it."""
        self.wire.retry()
        for identity, updates in self.requests.take_updates().items():
            self.wire.send_updates(identity, updates)
        self._end_undeliverable()

    def _end_undeliverable(self) -> None:
        """Requests whose updates cannot reach their gateway end here, their blocks freed: with an error when
        the gateway is still there to read it, so its client never gets a stream with tokens missing."""
        for identity in self.wire.behind():
            lost = self.wire.drop(identity) | self.requests.of_gateway(identity)
            why = f"this gateway fell behind reading its updates (over {self.wire.max_unsent} step messages)"
            self._undeliverable(identity, lost, why)
        for identity, request_ids in self.wire.oversized.items():
            why = f"an update larger than the protocol's {protocol.MAX_MESSAGE_BYTES} bytes"
            self._undeliverable(identity, request_ids, why)
        self.wire.oversized.clear()
        for identity in self.wire.gone:  # the abort updates go nowhere: the outbox drops what is for it
            self._abort_all(f"its gateway {identity.hex()} disconnected", identity)
        self.wire.gone.clear()

    def _undeliverable(self, identity: bytes, request_ids: set[str], why: str) -> None:
        for request_id in sorted(request_ids):
            owned = self.requests.get(request_id)
            trace_id = owned.trace_id if owned is not None else None
            if owned is not None and owned.identity == identity:
                self.engine.abort(request_id)
                self.requests.release(request_id, "undeliverable")
            message = f"updates of this request could not be delivered: {why}"
            self._send_error(identity, request_id, message, protocol.UNDELIVERABLE, trace_id)

    def _send_error(
        self, identity: bytes, request_id: str, message: str, code: int, trace_id: str | None = None
    ) -> None:
        level, what = (logging.ERROR, "failed") if code >= 500 else (logging.INFO, "refused")
        if code == protocol.BUSY:
            level = logging.DEBUG  # routine under load: the gateway sends the request elsewhere
        log.log(
            level,
            "request %s %s (%d): %s",
            request_id,
            what,
            code,
            message,
            extra=log_ids(request_id, trace_id),
        )
        self.wire.send(identity, protocol.RequestError(request_id, message, code))

    def _sync_adapters(self) -> None:
        """Serve the run-time LoRA registry as the heartbeat last read it; the registration says what changed."""
        if not self.engine.serves_adapters:
            return
        registry = self.index.adapter_registry
        if registry is not None and self.engine.sync_adapters(registry):
            self.index.update_info(self.engine.adapter_registration())

    def _publish(self, heartbeat: bool, changed: bool, step: StepResult | None = None) -> None:
        """The step's cache changes (the pool's and the KV tiers'), and the engine's numbers as they are now
        (aborts since the step count)."""
        stats = self.engine.stats()
        self.stats_pending |= changed
        cached, evicted = (step.cached, step.evicted) if step is not None else ([], [])
        tiers = step.tier_events if step is not None else self.engine.drain_tier_events()
        self.index.publish(cached, evicted, stats.load(), heartbeat, self._due_stats(stats), tiers)

    def _due_stats(self, stats: EngineStats) -> dict[str, float] | None:
        """The stats hash at most every STATS_INTERVAL_S while busy, and at once when the engine goes idle, so a
        finished request's counts show within a second. Its counters and gauges are the snapshot's, by name."""
        now = time.monotonic()
        if not self.stats_pending or (now < self.next_stats_at and self.engine.has_unfinished()):
            return None
        self.stats_pending, self.next_stats_at = False, now + STATS_INTERVAL_S
        for numbers in (self.stats.counters, self.stats.gauges):
            numbers.update({name: getattr(stats, name) for name in numbers if name not in COUNTED_HERE})
        return self.stats.to_hash()
