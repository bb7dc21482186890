"""A routed request sent to its executor and its updates read back, placed again elsewhere when that executor
refuses it as busy (or draining), or dies, or cuts it short, before the client has received anything."""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from collections.abc import Awaitable, Sequence

from gateway.api_error import APIError, invalid_request
from gateway.routing.adapters import Adapter
from gateway.routing.backlog import Backlog
from gateway.routing.executor_client import ExecutorClient, ExecutorGone, ExecutorRequestError
from gateway.routing.in_flight import InFlight
from gateway.routing.index_reader import IndexReader
from gateway.routing.router import Choice
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.request_span import RequestSpan
from gateway.tenants.tenancy import Caller
from shared import protocol

log = logging.getLogger("kvserve.gateway")
_GRAMMAR_ERROR = re.compile(
    r"structured_outputs\.\w+: "
)  # how the executor names a grammar it could not compile
# a request is started again from scratch on another executor at most this many times when its executor dies
# before the client has received anything (a request that kills every executor it reaches must stop somewhere)
MAX_EXECUTOR_LOSSES = 3


class CutShort(Exception):
    """The executor ended a choice this gateway did not stop (finish reason "abort"): it drained past its grace
    period. Its output is truncated, not finished, and is never passed off as a whole answer."""


def _named_for_client(error: ExecutorRequestError, field: str | None) -> Exception:
    """A grammar the executor could not compile is named by the request's own field (response_format, a tool's
    parameters, ...), not by the structured_outputs the gateway sent for it."""
    compiled = _GRAMMAR_ERROR.match(str(error))
    if error.code != 400 or field is None or compiled is None:
        return error
    reason = str(error)[compiled.end() :]
    if field == "tools":  # tool_choice "required" or a named function: held to the tools' parameters
        return invalid_request(f"tools: a function's parameters schema cannot be enforced: {reason}", field)
    return invalid_request(f"{field}: {reason}", field)


class Dispatch:
    """Chooses executors through the backlog, sends requests there and yields their updates."""

    def __init__(
        self,
        client: ExecutorClient,
        index: IndexReader,
        backlog: Backlog,
        metrics: GatewayMetrics,
        policy: str,
    ) -> None:
        self.client = client
        self.index = index
        self.backlog = backlog
        self.metrics = metrics
        self.policy = policy
        self.background: set[asyncio.Task] = set()

    async def choose(
        self,
        ids: Sequence[int],
        caller: Caller,
        arrival: float,
        span: RequestSpan,
        lost: set[str] = frozenset(),
        avoid: set[str] = frozenset(),
        busy_refusals: int = 0,
        adapter: Adapter | None = None,
    ) -> Choice:
        """An executor with room for the prompt (waiting in the backlog until one has), recorded in the metrics
        and as the span's `route` child."""
        started = time.time_ns()
        choice = await self.backlog.choose(ids, caller.tenant, arrival, lost, avoid, busy_refusals, adapter)
        self.metrics.route_decisions.labels(self.policy, choice.reason).inc()
        attributes = {
            "kvserve.route.policy": self.policy,
            "kvserve.route.reason": choice.reason,
            "kvserve.route.executor": choice.executor.executor_id,
            "kvserve.route.cached_blocks": choice.cached_blocks,
            "kvserve.route.cost": choice.cost,
            "kvserve.route.held_s": choice.held_s,
            # where the prompt's tokens come from there: computed, or their KV in its pool, tiers or a peer
            **{f"kvserve.route.tokens.{source}": n for source, n in choice.sources.by_source().items()},
        }
        if choice.kv_peer is not None:
            attributes["kvserve.route.kv_peer"] = choice.kv_peer.executor_id
        if choice.adapter is not None:
            attributes["kvserve.route.adapter"] = choice.adapter.identity
        span.child("route", started, attributes)
        return choice

    async def submit(self, flight: InFlight) -> None:
        """Send to the chosen executor, then count the request in its in-flight count until its first update,
        so concurrent routing decisions (any gateway's) see it before the executor's own load does."""
        placement = flight.placement
        await self.client.submit(placement.executor.address, flight.request, flight.timing)
        placement.counted_on = placement.executor.executor_id
        await self._add_inflight(placement.counted_on, placement.prefill_estimate)

    def uncount(self, flight: InFlight) -> None:
        placement = flight.placement
        if placement.counted_on is not None:
            # off the token's path
            self.in_background(self._add_inflight(placement.counted_on, -placement.prefill_estimate))
            placement.counted_on = None

    async def release(self, flight: InFlight) -> None:
        """However the request ended: out of its executor's count, freed there, its room offered to the backlog."""
        self.uncount(flight)
        await self.client.release(flight.placement.executor.address, flight.request.request_id)
        self.backlog.freed()

    def in_background(self, work: Awaitable[None]) -> None:
        """Work off the request's path, kept referenced until it is done."""
        task = asyncio.ensure_future(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _add_inflight(self, executor_id: str, delta: int) -> None:
        try:
            await self.index.add_inflight(executor_id, delta)
        except Exception as error:  # a routing hint only: the request goes on, the count's TTL heals it
            log.warning("in-flight count of %s not updated: %s", executor_id, error)

    async def updates(self, flight: InFlight):
        """The submitted request's updates. An executor that refuses it as busy (or draining) is replaced at
        once; one that dies is replaced if the client has received nothing yet: a non-streaming request starts
        again from scratch elsewhere, with the same seed; a stream that has had tokens ends with an error. One
        that cuts it short (it drained past its grace period: finish reason "abort") is as good as dead."""
        placement, delivered = flight.placement, flight.delivered
        while True:
            executor = placement.executor

            # an unreachable Redis says nothing of the executor: is_alive then answers True
            alive = functools.partial(self.index.is_alive, executor.executor_id)
            answered = False
            try:
                async for update in self.client.updates(
                    executor.address,
                    flight.request.request_id,
                    alive,
                    flight.timing,
                    len(delivered.generations),
                ):
                    if placement.counted_on is not None:  # the first update: it left the queue's places
                        self.uncount(flight)  # from now on the executor's published load counts it
                        self.backlog.freed()  # room there, perhaps
                    if protocol.is_acceptance(update):
                        continue  # taken, waiting for its grammar: nothing for the client yet
                    if (
                        update.finish_reason == "abort"
                        and not delivered.generations[update.index].stop_matched
                    ):
                        raise CutShort  # only a choice a stop string ended is aborted by this gateway
                    answered = True
                    delivered.kv_block_seconds += update.kv_block_seconds or 0.0
                    self._observe_tokens(flight, update)
                    yield update
                return
            except ExecutorRequestError as error:
                if answered or error.code not in protocol.REROUTABLE:
                    raise _named_for_client(error, flight.constraint_field) from None
                placement.busy_refusals += 1
                placement.busy_at.add(executor.executor_id)
                await self._reroute(flight, avoid=placement.busy_at)
            except (
                ExecutorGone,
                CutShort,
            ) as lost:  # UpdatesLost too: what it sent cannot be completed either
                what = "cut the request short" if isinstance(lost, CutShort) else lost.why
                log.warning(
                    "executor %s %s (request %s)", executor.executor_id, what, flight.request.request_id
                )
                placement.lost.add(executor.executor_id)
                if answered and flight.stream:
                    raise APIError(
                        502, f"executor {executor.executor_id} {what} mid-stream", "server_error"
                    ) from None
                if len(placement.lost) >= MAX_EXECUTOR_LOSSES:
                    raise APIError(
                        502, f"{len(placement.lost)} executors were lost serving this request", "server_error"
                    ) from None
                if answered:  # nothing reached the client: what the lost executor made is discarded
                    old = delivered.generations[0]
                    delivered.generations = flight.restart()
                    for generation in delivered.generations:
                        generation.id, generation.created = old.id, old.created
                await self._reroute(flight)

    async def _reroute(self, flight: InFlight, avoid: set[str] = frozenset()) -> None:
        """Send the request to another executor: one not lost with it, not in avoid, with room in its queue."""
        self.uncount(flight)
        placement = flight.placement
        choice = await self.choose(
            flight.request.prompt_token_ids,
            flight.caller,
            flight.arrival,
            flight.span,
            placement.lost,
            avoid,
            placement.busy_refusals,
            placement.adapter,
        )
        placement.executor, placement.prefill_estimate = choice.executor, choice.prefill_estimate
        placement.adapter = choice.adapter
        flight.request.block_hashes = choice.block_hashes  # its adapter's files may have changed meanwhile
        # the peer for the new executor's run: the old one's may be the new executor itself, or hold too little
        flight.request.kv_peer = choice.kv_peer
        placement.held_s += choice.held_s
        await self.submit(flight)

    async def stop_choice(self, flight: InFlight, update: protocol.RequestUpdate) -> None:
        """n > 1: a stop string ended one choice while the others go on; the executor stops generating it."""
        if update.finish_reason is None and flight.delivered.generations[update.index].stop_matched:
            await self.client.abort(
                flight.placement.executor.address, flight.request.request_id, update.index
            )

    def _observe_tokens(self, flight: InFlight, update: protocol.RequestUpdate) -> None:
        if not update.token_ids:
            return
        delivered = flight.delivered
        now = time.monotonic()
        if delivered.last_token_at is None:
            self.metrics.first_token(
                now - flight.arrival, flight.timing.executor_ttft, flight.placement.held_s
            )
            gap = None
        else:
            gap = now - delivered.last_token_at
        delivered.last_token_at = now
        self.metrics.tokens_arrived(
            flight.caller.tenant.name, flight.adapter_label, len(update.token_ids), gap
        )
