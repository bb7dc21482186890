"""One completion request, from its arrival to its end: who calls, what they ask, where it goes, the tokens back.

Stateless between requests: each one checks the caller's key from its headers before reading its body, reads the
live executors, their cached prefixes and loads from Redis, is admitted against the caller's limits, routed,
streamed back from the chosen executor over ZeroMQ (sent elsewhere if that executor is busy, or dies before the
client has received anything), settled, recorded and forgotten. While every executor's queue is full it waits at
the gateway (gateway.routing.backlog).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import re
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from gateway.api_error import APIError, internal_error, invalid_request
from gateway.openai.body import check_content_type, read_body
from gateway.openai.request import (
    OpenAIRequest,
    fit_to_context,
    model_not_found,
    parse_chat_request,
    parse_completion_request,
)
from gateway.openai.request_limits import DEFAULT_LIMITS, RequestLimits
from gateway.openai.responses import EventStream, Generation, response_body
from gateway.prompt.token_ids import prompt_token_ids
from gateway.prompt.workers import PromptWorkers
from gateway.routing.backlog import Backlog
from gateway.routing.executor_client import ExecutorClient, ExecutorGone, ExecutorRequestError, ExecutorTiming
from gateway.routing.index_reader import ExecutorInfo, IndexReader
from gateway.routing.router import Choice, Router
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.request_span import RequestSpan
from gateway.tenants.tenancy import Caller, Tenancy
from shared import logs, protocol

log = logging.getLogger("kvserve.gateway")
_GRAMMAR_ERROR = re.compile(
    r"structured_outputs\.\w+: "
)  # how the executor names a grammar it could not compile
T = TypeVar("T")

EXECUTOR_HEADER = "x-kvserve-executor"
REQUEST_ID_HEADER = "x-request-id"  # the id the gateway's and executor's log lines carry
NO_EXECUTOR = "none"  # the header's value when a request was answered before reaching one
DISCONNECT_POLL_S = 0.25
# a request is started again from scratch on another executor at most this many times when its executor dies
# before the client has received anything (a request that kills every executor it reaches must stop somewhere)
MAX_EXECUTOR_LOSSES = 3
# a refused request's unread body up to this is left to uvicorn to discard, keeping the connection; a larger one
# closes it (a client still sending may then see the connection reset rather than the 401)
CLOSE_UNREAD_BODY_BYTES = 64 * 1024


@dataclass(slots=True)
class Routed:
    executor: ExecutorInfo  # changes if the first choice dies before answering
    request: protocol.GenerateRequest
    generations: list[Generation]  # one per choice (n)
    fresh: Callable[[], list[Generation]]  # the choices as they start, for a restart on another executor
    stream: bool
    include_usage: bool
    arrival: float  # time.monotonic() when the HTTP request came in
    caller: Caller
    span: RequestSpan
    reserved_tokens: int  # prompt + n x max_tokens, taken from the caller's tokens-per-minute budget
    tried: set[str] = dataclasses.field(default_factory=set)  # executors lost while serving it
    timing: ExecutorTiming = dataclasses.field(default_factory=ExecutorTiming)
    prefill_estimate: int = 0  # prompt tokens the chosen executor has to prefill, by its cached blocks
    counted_on: str | None = None  # the executor whose in-flight count in Redis includes this request
    last_token_at: float | None = None  # time.monotonic() of the last update with tokens
    held_s: float = 0.0  # time it waited at the gateway for an executor with room (gateway.routing.backlog)
    status: int = 200  # what the request's metrics and span report at its end
    error: str | None = None
    constraint_field: str | None = None  # OpenAIRequest.constraint_field
    busy_refusals: int = 0  # times executors refused it as busy: its backoff before asking again
    # executors that refused it as busy: skipped while another has room. The gateway counts a tenant's places by
    # what it sent itself, so two executors full of another gateway's requests of the tenant would otherwise bounce
    # it between them without pause until a place freed, past its queue timeout.
    busy_at: set[str] = field(default_factory=set)
    kv_block_seconds: float = 0.0  # what its KV held, as its executor's last update said


def _unread_body_bytes(request: Request) -> int:
    """The body's declared length (chunked: unknown, so counted as large), for a request whose body was not read."""
    if "chunked" in request.headers.get("transfer-encoding", "").lower():
        return sys.maxsize
    length = request.headers.get("content-length", "0")
    return int(length) if length.isdigit() else 0


def error_response(error: APIError, request_id: str, executor_id: str = NO_EXECUTOR) -> JSONResponse:
    headers = {**error.headers, EXECUTOR_HEADER: executor_id}
    if request_id:
        headers[REQUEST_ID_HEADER] = request_id
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


class ReleasingStreamingResponse(StreamingResponse):
    """Runs `release(completed)` however the response ends, even when the client left before the first event
    (then the body generator never started, and its own cleanup never runs); `completed` says whether the
    whole stream went out, as against a client that left (Starlette then cancels the stream quietly)."""

    def __init__(self, content, release: Callable[[bool], Awaitable[None]], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.release = release
        self.completed = False

    async def stream_response(self, send) -> None:
        await super().stream_response(send)
        self.completed = True

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.release(self.completed)


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class CutShort(Exception):
    """The executor ended a choice this gateway did not stop (finish reason "abort"): it drained past its grace
    period. Its output is truncated, not finished, and is never passed off as a whole answer."""


async def _while_connected(request: Request, work: Awaitable[T]) -> T:
    """work's result; if the client disconnects first, work is cancelled (which aborts whatever it started on
    an executor, or takes it out of the backlog) and ClientGone is raised."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                raise ClientGone
        return task.result()
    finally:
        task.cancel()  # a no-op once it is done


def _as_api_error(caught: Exception, request_id: str) -> APIError:
    """What the client is told of a request that failed: the error as it stands, the executor's in OpenAI's
    shape, or, for a fault of ours, a 500 whose traceback goes to the log."""
    if isinstance(caught, APIError):
        return caught
    if isinstance(caught, ExecutorRequestError):
        kind = "invalid_request_error" if caught.code < 500 else "server_error"
        return APIError(caught.code, str(caught), kind)
    log.error("request failed unexpectedly", exc_info=caught)
    return internal_error(request_id)


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


def _tenant(caller: Caller | None) -> str:
    return caller.tenant if caller else "unauthenticated"


class Completions:
    """Serves /v1/chat/completions and /v1/completions with the gateway's parts."""

    def __init__(
        self,
        model_name: str,
        tokenizer,
        index: IndexReader,
        router: Router,
        tenancy: Tenancy,
        client: ExecutorClient,
        metrics: GatewayMetrics,
        backlog: Backlog,
        tool_call_parser: str | None,
        body_timeout_s: float,
        limits: RequestLimits = DEFAULT_LIMITS,
    ) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.index = index
        self.router = router
        self.tenancy = tenancy
        self.client = client
        self.metrics = metrics
        self.backlog = backlog
        self.tool_call_parser = tool_call_parser
        self.limits = limits
        self.body_timeout_s = body_timeout_s
        self.prompt_workers = PromptWorkers()
        self.background: set[asyncio.Task] = set()

    def close(self) -> None:
        self.prompt_workers.close()

    async def serve(self, request: Request, endpoint: str) -> Response:
        arrival = time.monotonic()
        request_id = uuid.uuid4().hex
        span = RequestSpan.start(request.headers, endpoint, time.time_ns())
        # this request's task (and tasks it starts) log with its ids; the binding ends with the task
        logs.bind(request_id, span.trace_id(request.headers))
        caller = None
        try:
            # from the headers alone: a 401 reads no byte of the body (uvicorn discards a small one and keeps
            # the connection; a large one closes it, below), so a caller without a valid key costs next to nothing
            caller = await self.tenancy.identify(request.headers)
            parsed, ids = await self._read(request, endpoint, span)
            allowed = caller.models([self.model_name])
            if parsed.model not in allowed:
                raise model_not_found(parsed.model, allowed)
            # before routing: a prompt no executor takes costs Redis no routing read, and a caller past its limits
            # hears so on arrival, not after a wait in the backlog
            params = fit_to_context(parsed, len(ids), await self.router.max_model_len(), self.limits)
            reserved_tokens = len(ids) + params.n * params.max_tokens  # n choices: n outputs, one prompt
            await self.tenancy.admit(caller, request_id, reserved_tokens)
            try:  # it may wait in the backlog: a client that leaves meanwhile takes it out
                routed = await _while_connected(
                    request, self._route(parsed, ids, arrival, request_id, caller, span, reserved_tokens)
                )
            except Exception as caught:  # it never reached an executor: its admission is given back
                await self._withdraw(caller, request_id, reserved_tokens)
                if isinstance(caught, ClientGone):
                    raise APIError(
                        499, "the client disconnected while its request waited for an executor"
                    ) from None
                raise
        except ClientDisconnect:  # the client left while sending its body: no one to answer, nothing broke
            log.info("client disconnected while sending its request body")
            self.metrics.requests.labels(_tenant(caller), endpoint, "499").inc()
            span.finish(499, "client disconnected")
            return Response(status_code=499)
        except Exception as caught:
            error = _as_api_error(caught, request_id)
            log.info("request refused (%d, tenant %s): %s", error.status, _tenant(caller), error.message)
            self.metrics.requests.labels(_tenant(caller), endpoint, str(error.status)).inc()
            span.finish(error.status, error.message)
            response = error_response(error, request_id)
            if caller is None and _unread_body_bytes(request) > CLOSE_UNREAD_BODY_BYTES:
                # keeping the connection would mean reading the body only to discard it: a keyless flood of
                # large bodies then costs the gateway what they weigh. Closed, it costs what one buffer holds.
                response.headers["connection"] = "close"
            return response
        try:
            # sent before the response starts, so the executor works while the HTTP machinery sets up
            await self._submit(routed)
        except Exception as caught:
            error = _as_api_error(caught, request_id)
            self._failed(routed, error)
            await self._end(routed)
            return error_response(error, request_id)
        except BaseException:
            await self._end(routed)
            raise
        if routed.stream:
            return ReleasingStreamingResponse(
                self._events(routed),
                release=lambda completed: self._end_stream(routed, completed),
                media_type="text/event-stream",
                headers={
                    EXECUTOR_HEADER: routed.executor.executor_id,
                    REQUEST_ID_HEADER: request_id,
                    "cache-control": "no-cache",
                },
            )
        try:
            return await self._whole(request, routed)
        finally:
            await self._end(routed)

    async def _withdraw(self, caller: Caller, request_id: str, reserved_tokens: int) -> None:
        try:
            await self.tenancy.withdraw(caller, request_id, reserved_tokens)
        # as in _end: the slot's lease and the bucket's refill heal what this misses
        except Exception as error:
            log.error("giving back tenant %s's limits failed: %s", caller.tenant, error)

    async def _submit(self, routed: Routed) -> None:
        """Send to the chosen executor, then count the request in its in-flight count until its first update,
        so concurrent routing decisions (any gateway's) see it before the executor's own load does."""
        await self.client.submit(routed.executor.address, routed.request, routed.timing)
        routed.counted_on = routed.executor.executor_id
        await self._add_inflight(routed.counted_on, routed.prefill_estimate)

    def _uncount(self, routed: Routed) -> None:
        if routed.counted_on is not None:
            # off the token's path
            self._in_background(self._add_inflight(routed.counted_on, -routed.prefill_estimate))
            routed.counted_on = None

    def _in_background(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _add_inflight(self, executor_id: str, delta: int) -> None:
        try:
            await self.index.add_inflight(executor_id, delta)
        except Exception as error:  # a routing hint only: the request goes on, the count's TTL heals it
            log.warning("in-flight count of %s not updated: %s", executor_id, error)

    async def _end_stream(self, routed: Routed, completed: bool) -> None:
        if not completed and routed.status == 200:  # the client left: a 499, though it had a 200 status line
            routed.status = 499
        await self._end(routed)

    async def _end(self, routed: Routed) -> None:
        """However the request ended: free it on the executor, settle the caller's budget, record it."""
        self._uncount(routed)
        await self.client.release(routed.executor.address, routed.request.request_id)
        self.backlog.freed()
        generation = routed.generations[0]
        completion_tokens = sum(g.output.num_tokens for g in routed.generations)
        if routed.error is not None and not routed.stream:  # it failed: the client was given none of them
            completion_tokens = 0
        usage = (generation.num_prompt_tokens, completion_tokens, generation.cached_tokens)
        tenant = routed.caller.tenant
        self.metrics.requests.labels(tenant, generation.endpoint, str(routed.status)).inc()
        self.metrics.count_usage(tenant, usage[0], usage[2], routed.kv_block_seconds)
        self.metrics.e2e.observe(time.monotonic() - routed.arrival)
        routed.span.finish(
            routed.status,
            routed.error,
            usage,
            generation.finish_reason,
            generation.id,
            routed.executor.executor_id,
        )
        try:
            await self.tenancy.release(
                routed.caller,
                routed.request.request_id,
                routed.reserved_tokens,
                *usage,
                kv_block_seconds=routed.kv_block_seconds,
            )
        except Exception as error:  # the slot's lease and the bucket's refill heal what this misses
            log.error("settling tenant %s's limits failed: %s", tenant, error)
        owed = self.client.owed_kv_block_seconds(routed.request.request_id)
        if owed is not None:  # aborted before its last update: its executor says what its KV held later
            self._in_background(self._bill_owed(routed.caller, routed.request.request_id, owed))

    async def _bill_owed(self, caller: Caller, request_id: str, owed: Awaitable[float | None]) -> None:
        kv_block_seconds = await owed
        if not kv_block_seconds:
            return
        self.metrics.kv_block_seconds.labels(caller.tenant).inc(kv_block_seconds)
        try:
            await self.tenancy.count_kv_block_seconds(caller, request_id, kv_block_seconds)
        except Exception as error:  # as in _end: billing must not fail a request, and this one has ended
            log.error("counting tenant %s's KV block-seconds failed: %s", caller.tenant, error)

    async def _read(
        self, request: Request, endpoint: str, span: RequestSpan
    ) -> tuple[OpenAIRequest, list[int]]:
        """The request body, read within the deadline, parsed and validated, and its prompt's token ids; a large
        one is parsed and tokenized off the event loop."""
        check_content_type(request.headers.get("content-type"))
        raw = await read_body(request, self.body_timeout_s)
        work = functools.partial(self._prompt, raw, endpoint)
        parsed, ids, tokenizing_since = await self.prompt_workers.run(work, len(raw))
        span.child("tokenize", tokenizing_since, {"gen_ai.usage.input_tokens": len(ids)})
        if not ids:
            raise APIError(400, "the prompt is empty", param="messages" if endpoint == "chat" else "prompt")
        return parsed, ids

    def _prompt(self, raw: bytes, endpoint: str) -> tuple[OpenAIRequest, list[int], int]:
        """(the parsed request, its prompt's ids, when tokenizing began in ns): in a worker thread for a large
        body, so it touches nothing the event loop's tasks change."""
        if endpoint == "chat":
            parsed = parse_chat_request(raw, [self.model_name], self.tool_call_parser, self.limits)
        else:
            parsed = parse_completion_request(raw, [self.model_name], self.limits)
        started = time.time_ns()
        return parsed, prompt_token_ids(parsed, self.tokenizer), started

    async def _route(
        self,
        parsed: OpenAIRequest,
        ids: list[int],
        arrival: float,
        request_id: str,
        caller: Caller,
        span: RequestSpan,
        reserved_tokens: int,
    ) -> Routed:
        started = time.time_ns()
        choice = await self.backlog.choose(ids, caller.cache_salt, arrival, tenant=caller.key_tenant)
        self._record_route(span, started, choice)
        # again for the one chosen: executors may differ in their context length
        params = fit_to_context(parsed, len(ids), choice.executor.max_model_len, self.limits)
        span.describe(caller.tenant, parsed.model, params.max_tokens, params.temperature, params.top_p)
        generate = protocol.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=ids,
            block_hashes=choice.block_hashes,
            sampling=dataclasses.asdict(params),
            tenant=caller.key_tenant,
            tenant_weight=caller.weight,
            priority=parsed.priority,
            cache_salt=caller.cache_salt,
            traceparent=span.traceparent(),
        )

        def fresh() -> list[Generation]:
            return Generation.start_all(parsed, ids, params.stop, self.tokenizer)

        return Routed(
            choice.executor,
            generate,
            fresh(),
            fresh,
            parsed.stream,
            parsed.include_usage,
            arrival,
            caller,
            span,
            reserved_tokens=reserved_tokens,
            prefill_estimate=choice.prefill_estimate,
            held_s=choice.held_s,
            constraint_field=parsed.constraint_field,
        )

    def _record_route(self, span: RequestSpan, started_ns: int, choice: Choice) -> None:
        self.metrics.route_decisions.labels(self.router.policy, choice.reason).inc()
        attributes = {
            "kvserve.route.policy": self.router.policy,
            "kvserve.route.reason": choice.reason,
            "kvserve.route.executor": choice.executor.executor_id,
            "kvserve.route.cached_blocks": choice.cached_blocks,
            "kvserve.route.cost": choice.cost,
            "kvserve.route.held_s": choice.held_s,
        }
        span.child("route", started_ns, attributes)

    async def _updates(self, routed: Routed):
        """The submitted request's updates. An executor that refuses it as busy (or draining) is replaced at
        once; one that dies is replaced if the client has received nothing yet: a non-streaming request starts
        again from scratch elsewhere, with the same seed; a stream that has had tokens ends with an error. One
        that cuts it short (it drained past its grace period: finish reason "abort") is as good as dead."""
        while True:
            executor = routed.executor

            # an unreachable Redis says nothing of the executor: is_alive then answers True
            alive = functools.partial(self.index.is_alive, executor.executor_id)
            answered = False
            try:
                async for update in self.client.updates(
                    executor.address, routed.request.request_id, alive, routed.timing, len(routed.generations)
                ):
                    if routed.counted_on is not None:  # the first update: it left the queue's places
                        self._uncount(routed)  # from now on the executor's published load counts it
                        self.backlog.freed()  # room there, perhaps
                    if protocol.is_acceptance(update):
                        continue  # taken, waiting for its grammar: nothing for the client yet
                    if update.finish_reason == "abort" and not routed.generations[update.index].stop_matched:
                        raise CutShort  # only a choice a stop string ended is aborted by this gateway
                    answered = True
                    routed.kv_block_seconds += update.kv_block_seconds or 0.0
                    self._observe_tokens(routed, update)
                    yield update
                return
            except ExecutorRequestError as error:
                if answered or error.code not in protocol.REROUTABLE:
                    raise _named_for_client(error, routed.constraint_field) from None
                routed.busy_refusals += 1
                routed.busy_at.add(executor.executor_id)
                await self._reroute(routed, avoid=routed.busy_at)
            except (
                ExecutorGone,
                CutShort,
            ) as lost:  # UpdatesLost too: what it sent cannot be completed either
                what = "cut the request short" if isinstance(lost, CutShort) else lost.why
                log.warning(
                    "executor %s %s (request %s)", executor.executor_id, what, routed.request.request_id
                )
                routed.tried.add(executor.executor_id)
                if answered and routed.stream:
                    raise APIError(
                        502, f"executor {executor.executor_id} {what} mid-stream", "server_error"
                    ) from None
                if len(routed.tried) >= MAX_EXECUTOR_LOSSES:
                    raise APIError(
                        502, f"{len(routed.tried)} executors were lost serving this request", "server_error"
                    ) from None
                if answered:  # nothing reached the client: what the lost executor made is discarded
                    old = routed.generations[0]
                    routed.generations = routed.fresh()
                    for generation in routed.generations:
                        generation.id, generation.created = old.id, old.created
                await self._reroute(routed)

    async def _reroute(self, routed: Routed, avoid: set[str] = frozenset()) -> None:
        """Send the request to another executor: one not lost with it, not in avoid, with room in its queue."""
        self._uncount(routed)
        started = time.time_ns()
        choice = await self.backlog.choose(
            routed.request.prompt_token_ids,
            routed.caller.cache_salt,
            routed.arrival,
            routed.tried,
            avoid,
            routed.busy_refusals,
            routed.caller.key_tenant,
        )
        self._record_route(routed.span, started, choice)
        routed.executor, routed.prefill_estimate = choice.executor, choice.prefill_estimate
        routed.held_s += choice.held_s
        await self._submit(routed)

    async def _events(self, routed: Routed):
        stream = EventStream(routed.generations, routed.include_usage)
        try:
            async for update in self._updates(routed):
                text = stream.update(
                    update.token_ids,
                    update.logprobs,
                    update.finish_reason,
                    update.num_cached_tokens,
                    update.index,
                    update.prompt_logprobs,
                )
                if text:
                    yield text
                if stream.finished:
                    return  # a stop string matched: leaving the loop aborts the executor request
                await self._stop_choice(routed, update)
        except Exception as caught:
            error = _as_api_error(caught, routed.request.request_id)
            self._failed(routed, error)
            yield error.sse_event()

    async def _stop_choice(self, routed: Routed, update: protocol.RequestUpdate) -> None:
        """n > 1: a stop string ended one choice while the others go on; the executor stops generating it."""
        if update.finish_reason is None and routed.generations[update.index].stop_matched:
            await self.client.abort(routed.executor.address, routed.request.request_id, update.index)

    def _failed(self, routed: Routed, error: APIError) -> None:
        routed.status, routed.error = error.status, error.message
        log.warning("request failed (%d): %s", error.status, error.message)

    def _observe_tokens(self, routed: Routed, update: protocol.RequestUpdate) -> None:
        if not update.token_ids:
            return
        now = time.monotonic()
        if routed.last_token_at is None:
            self.metrics.first_token(now - routed.arrival, routed.timing.executor_ttft, routed.held_s)
            gap = None
        else:
            gap = now - routed.last_token_at
        routed.last_token_at = now
        self.metrics.tokens_arrived(routed.caller.tenant, len(update.token_ids), gap)

    async def _whole(self, request: Request, routed: Routed) -> Response:
        async def collect() -> None:
            async for update in self._updates(routed):
                generations = routed.generations  # a restart on another executor replaces them
                generations[update.index].feed(
                    update.token_ids,
                    update.logprobs,
                    update.finish_reason,
                    update.num_cached_tokens,
                    update.prompt_logprobs,
                )
                if all(g.finished for g in generations):
                    return
                await self._stop_choice(routed, update)

        try:
            await _while_connected(request, collect())
        except ClientGone:
            routed.status = 499
            return Response(status_code=499)
        except Exception as caught:
            error = _as_api_error(caught, routed.request.request_id)
        else:
            # the executor that answered: a retry may have replaced the first choice
            headers = {
                EXECUTOR_HEADER: routed.executor.executor_id,
                REQUEST_ID_HEADER: routed.request.request_id,
            }
            return JSONResponse(response_body(routed.generations), headers=headers)
        self._failed(routed, error)
        return error_response(error, routed.request.request_id, routed.executor.executor_id)
