"""One completion request, from its arrival to its end: who calls, what they ask, where it goes, the tokens back.

Stateless between requests: each one checks the caller's key from its headers before reading its body, reads the
live executors, their cached prefixes and loads from Redis, is admitted against the caller's limits, routed,
streamed back from the chosen executor over ZeroMQ (sent elsewhere if that executor is busy, or dies before the
client has received anything: gateway.routing.dispatch), settled, recorded and forgotten. While every executor's
queue is full it waits at the gateway (gateway.routing.backlog). What it holds while served is an InFlight
(gateway/in_flight.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from gateway.api_error import EXECUTOR_HEADER, REQUEST_ID_HEADER, APIError, error_response, internal_error
from gateway.in_flight import Delivered, InFlight, Placement
from gateway.openai.body import check_content_type, read_body, read_json_body
from gateway.openai.request import (
    OpenAIRequest,
    fit_to_context,
    model_not_found,
    parse_chat_request,
    parse_completion_request,
)
from gateway.openai.request_limits import DEFAULT_LIMITS, RequestLimits
from gateway.openai.responses import ChatReply, Generation
from gateway.openai.responses_api import as_responses_error, parse_responses_body
from gateway.prompt.token_ids import prompt_token_ids
from gateway.prompt.workers import PromptWorkers
from gateway.response_store import ResponseStore
from gateway.responses_turn import ResponsesReply, history
from gateway.routing.dispatch import Dispatch
from gateway.routing.executor_client import ExecutorClient, ExecutorRequestError
from gateway.routing.router import Router
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.request_span import RequestSpan
from gateway.tenants.tenancy import Caller, Tenancy
from shared import logs, protocol

log = logging.getLogger("kvserve.gateway")
T = TypeVar("T")

DISCONNECT_POLL_S = 0.25
# a refused request's unread body up to this is left to uvicorn to discard, keeping the connection; a larger one
# closes it (a client still sending may then see the connection reset rather than the 401)
CLOSE_UNREAD_BODY_BYTES = 64 * 1024


def _unread_body_bytes(request: Request) -> int:
    """The body's declared length (chunked: unknown, so counted as large), for a request whose body was not read."""
    if "chunked" in request.headers.get("transfer-encoding", "").lower():
        return sys.maxsize
    length = request.headers.get("content-length", "0")
    return int(length) if length.isdigit() else 0


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


def _tenant(caller: Caller | None) -> str:
    return caller.tenant if caller else "unauthenticated"


class Completions:
    """Serves /v1/chat/completions, /v1/completions and /v1/responses with the gateway's parts."""

    def __init__(
        self,
        model_name: str,
        tokenizer,
        router: Router,
        tenancy: Tenancy,
        client: ExecutorClient,
        metrics: GatewayMetrics,
        dispatch: Dispatch,
        tool_call_parser: str | None,
        body_timeout_s: float,
        limits: RequestLimits = DEFAULT_LIMITS,
        store: ResponseStore | None = None,
    ) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.router = router
        self.tenancy = tenancy
        self.client = client
        self.metrics = metrics
        self.dispatch = dispatch
        self.tool_call_parser = tool_call_parser
        self.limits = limits
        self.body_timeout_s = body_timeout_s
        self.store = store  # stored responses (/v1/responses)
        self.prompt_workers = PromptWorkers()

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
            parsed, ids, reply = await self._read(request, endpoint, span, caller)
            allowed = caller.models([self.model_name])
            if parsed.model not in allowed:
                raise model_not_found(parsed.model, allowed)
            # before routing: a prompt no executor takes costs Redis no routing read, and a caller past its limits
            # hears so on arrival, not after a wait in the backlog
            params = fit_to_context(parsed, len(ids), await self.router.max_model_len(), self.limits)
            reserved_tokens = len(ids) + params.n * params.max_tokens  # n choices: n outputs, one prompt
            await self.tenancy.admit(caller, request_id, reserved_tokens)
            try:  # it may wait in the backlog: a client that leaves meanwhile takes it out
                flight = await _while_connected(
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
            if endpoint == "responses":  # the chat path's checks name chat's fields
                error = as_responses_error(error)
            log.info("request refused (%d, tenant %s): %s", error.status, _tenant(caller), error.message)
            self.metrics.requests.labels(_tenant(caller), endpoint, str(error.status)).inc()
            span.finish(error.status, error.message)
            response = error_response(error, request_id)
            if caller is None and _unread_body_bytes(request) > CLOSE_UNREAD_BODY_BYTES:
                # keeping the connection would mean reading the body only to discard it: a keyless flood of
                # large bodies then costs the gateway what they weigh. Closed, it costs what one buffer holds.
                response.headers["connection"] = "close"
            return response
        flight.endpoint = endpoint
        try:
            # sent before the response starts, so the executor works while the HTTP machinery sets up
            await self.dispatch.submit(flight)
        except Exception as caught:
            error = _as_api_error(caught, request_id)
            self._failed(flight, error)
            await self._end(flight)
            return error_response(error, request_id)
        except BaseException:
            await self._end(flight)
            raise
        if flight.stream:
            return ReleasingStreamingResponse(
                self._events(flight, reply),
                release=lambda completed: self._end_stream(flight, completed),
                media_type="text/event-stream",
                headers={
                    EXECUTOR_HEADER: flight.placement.executor.executor_id,
                    REQUEST_ID_HEADER: request_id,
                    "cache-control": "no-cache",
                },
            )
        try:
            return await self._whole(request, flight, reply)
        finally:
            await self._end(flight)

    async def _withdraw(self, caller: Caller, request_id: str, reserved_tokens: int) -> None:
        try:
            await self.tenancy.withdraw(caller, request_id, reserved_tokens)
        # as in _end: the slot's lease and the bucket's refill heal what this misses
        except Exception as error:
            log.error("giving back tenant %s's limits failed: %s", caller.tenant, error)

    async def _end_stream(self, flight: InFlight, completed: bool) -> None:
        if not completed and flight.status == 200:  # the client left: a 499, though it had a 200 status line
            flight.status = 499
        await self._end(flight)

    async def _end(self, flight: InFlight) -> None:
        """However the request ended: free it on the executor, settle the caller's budget, record it."""
        self.dispatch.uncount(flight)
        await self.client.release(flight.placement.executor.address, flight.request.request_id)
        self.dispatch.backlog.freed()
        generation = flight.delivered.generations[0]
        completion_tokens = sum(g.output.num_tokens for g in flight.delivered.generations)
        if flight.error is not None and not flight.stream:  # it failed: the client was given none of them
            completion_tokens = 0
        usage = (generation.num_prompt_tokens, completion_tokens, generation.cached_tokens)
        tenant = flight.caller.tenant
        self.metrics.requests.labels(tenant, flight.endpoint, str(flight.status)).inc()
        self.metrics.count_usage(tenant, usage[0], usage[2], flight.delivered.kv_block_seconds)
        self.metrics.e2e.observe(time.monotonic() - flight.arrival)
        flight.span.finish(
            flight.status,
            flight.error,
            usage,
            generation.finish_reason,
            generation.id,
            flight.placement.executor.executor_id,
        )
        try:
            await self.tenancy.release(
                flight.caller,
                flight.request.request_id,
                flight.reserved_tokens,
                *usage,
                kv_block_seconds=flight.delivered.kv_block_seconds,
            )
        except Exception as error:  # the slot's lease and the bucket's refill heal what this misses
            log.error("settling tenant %s's limits failed: %s", tenant, error)
        owed = self.client.owed_kv_block_seconds(flight.request.request_id)
        if owed is not None:  # aborted before its last update: its executor says what its KV held later
            self.dispatch.in_background(self._bill_owed(flight.caller, flight.request.request_id, owed))

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
        self, request: Request, endpoint: str, span: RequestSpan, caller: Caller
    ) -> tuple[OpenAIRequest, list[int], ChatReply | ResponsesReply]:
        """The request body, read within the deadline, parsed and validated, its prompt's token ids and how it is
        answered; a large one is parsed and tokenized off the event loop."""
        check_content_type(request.headers.get("content-type"))
        raw = await read_body(request, self.body_timeout_s)
        # a /v1/responses body names the conversation it continues, read from Redis before its prompt is built
        if endpoint == "responses":
            body = await self.prompt_workers.run(functools.partial(read_json_body, raw), len(raw))
            items = await history(self.store, caller.tenant, body)
            work = functools.partial(self._responses_prompt, body, items)
            turn, ids, tokenizing_since = await self.prompt_workers.run(work, len(raw))
            parsed, reply = turn.chat, ResponsesReply(turn, self.store, caller.tenant)
        else:
            work = functools.partial(self._prompt, raw, endpoint)
            parsed, ids, tokenizing_since = await self.prompt_workers.run(work, len(raw))
            reply = ChatReply(parsed.include_usage)
        span.child("tokenize", tokenizing_since, {"gen_ai.usage.input_tokens": len(ids)})
        if not ids:
            param = {"chat": "messages", "responses": "input"}.get(endpoint, "prompt")
            raise APIError(400, "the prompt is empty", param=param)
        return parsed, ids, reply

    def _responses_prompt(self, body: dict, items: list[dict]):
        """As _prompt, for a /v1/responses body and the conversation it continues."""
        turn = parse_responses_body(body, items, [self.model_name], self.tool_call_parser, self.limits)
        if turn.store:  # a conversation too large to store is refused before it is answered
            self.store.check_size(turn.items)
        started = time.time_ns()
        return turn, prompt_token_ids(turn.chat, self.tokenizer), started

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
    ) -> InFlight:
        choice = await self.dispatch.choose(ids, caller, arrival, span)
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

        def restart() -> list[Generation]:
            return Generation.start_all(parsed, ids, params.stop, self.tokenizer)

        return InFlight(
            generate,
            caller,
            span,
            arrival,
            reserved_tokens,
            parsed.stream,
            parsed.include_usage,
            parsed.constraint_field,
            restart,
            Placement(choice.executor, choice.prefill_estimate, choice.held_s),
            Delivered(restart()),
        )

    async def _events(self, flight: InFlight, reply: ChatReply | ResponsesReply):
        stream = reply.events(flight.delivered.generations)
        try:
            async for update in self.dispatch.updates(flight):
                text = stream.update(
                    update.token_ids,
                    update.logprobs,
                    update.finish_reason,
                    update.num_cached_tokens,
                    update.index,
                    update.prompt_logprobs,
                )
                if stream.finished:  # stored (a Response) before the client hears it is complete
                    await reply.streamed(stream)
                if text:
                    yield text
                if stream.finished:
                    return  # a stop string matched: leaving the loop aborts the executor request
                await self.dispatch.stop_choice(flight, update)
        except Exception as caught:
            error = _as_api_error(caught, flight.request.request_id)
            self._failed(flight, error)
            yield reply.error_event(stream, error)

    def _failed(self, flight: InFlight, error: APIError) -> None:
        flight.status, flight.error = error.status, error.message
        log.warning("request failed (%d): %s", error.status, error.message)

    async def _whole(self, request: Request, flight: InFlight, reply: ChatReply | ResponsesReply) -> Response:
        async def collect() -> None:
            async for update in self.dispatch.updates(flight):
                generations = flight.delivered.generations  # a restart on another executor replaces them
                generations[update.index].feed(
                    update.token_ids,
                    update.logprobs,
                    update.finish_reason,
                    update.num_cached_tokens,
                    update.prompt_logprobs,
                )
                if all(g.finished for g in generations):
                    return
                await self.dispatch.stop_choice(flight, update)

        try:
            await _while_connected(request, collect())
        except ClientGone:
            flight.status = 499
            return Response(status_code=499)
        except Exception as caught:
            error = _as_api_error(caught, flight.request.request_id)
        else:
            # the executor that answered: a retry may have replaced the first choice
            headers = {
                EXECUTOR_HEADER: flight.placement.executor.executor_id,
                REQUEST_ID_HEADER: flight.request.request_id,
            }
            return JSONResponse(await reply.whole(flight.delivered.generations), headers=headers)
        self._failed(flight, error)
        return error_response(error, flight.request.request_id, flight.placement.executor.executor_id)
