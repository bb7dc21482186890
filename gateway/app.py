"""The HTTP face of kvserve: OpenAI-compatible routes over executors found in Redis.

Stateless between requests: each one reads the live executors, their cached prefixes and loads from Redis,
routes, streams tokens back from the chosen executor over ZeroMQ, and forgets.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.api_error import APIError
from gateway.executor_client import ExecutorClient, ExecutorGone, ExecutorRequestError, ExecutorTiming
from gateway.executor_directory import ExecutorDirectory, ExecutorInfo
from gateway.metrics import GatewayMetrics
from gateway.openai_protocol import (
    MAX_BODY_BYTES,
    fit_to_context,
    parse_chat_request,
    parse_completion_request,
)
from gateway.prompt import prompt_token_ids
from gateway.responses import EventStream, Generation, response_body
from gateway.routing import Candidate, prefill_tokens, route_request
from shared import protocol
from shared.block_hash import hash_blocks
from shared.defaults import DEFAULT_BLOCK_SIZE

log = logging.getLogger("kvserve.gateway")

EXECUTOR_HEADER = "x-kvserve-executor"
NO_EXECUTOR = "none"  # the header's value when a request was answered before reaching one
DISCONNECT_POLL_S = 0.25


ROUTING_POLICIES = ("cache_aware", "round_robin", "random")


@dataclass
class GatewayConfig:
    redis_url: str
    model_name: str
    tokenizer: object
    routing_policy: str = "cache_aware"


@dataclass(slots=True)
class Routed:
    executor: ExecutorInfo  # changes if the first choice dies before answering
    request: protocol.GenerateRequest
    generation: Generation
    stream: bool
    include_usage: bool
    arrival: float  # time.monotonic() when the HTTP request came in
    tried: set[str] = dataclasses.field(default_factory=set)
    timing: ExecutorTiming = dataclasses.field(default_factory=ExecutorTiming)
    prefill_estimate: int = 0  # prompt tokens the chosen executor has to prefill, by its cached blocks
    counted_on: str | None = None  # the executor whose in-flight count in Redis includes this request
    first_token_seen: bool = False


def _error(error: APIError, executor_id: str = NO_EXECUTOR) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers={EXECUTOR_HEADER: executor_id})


class ReleasingStreamingResponse(StreamingResponse):
    """Runs `release` however the response ends, even when the client left before the first event (then the
    body generator never started, and its own cleanup never runs)."""

    def __init__(self, content, release: Callable[[], Awaitable[None]], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.release()


def _executor_error(error: ExecutorRequestError) -> APIError:
    kind = "invalid_request_error" if error.code < 500 else "server_error"
    return APIError(error.code, str(error), kind)


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.directory = ExecutorDirectory(config.redis_url)
        self.client: ExecutorClient | None = None
        self.metrics = GatewayMetrics()
        self.background: set[asyncio.Task] = set()

    async def startup(self) -> None:
        self.client = ExecutorClient()

    async def shutdown(self) -> None:
        if self.client is not None:
            await self.client.close()
        await self.directory.close()

    # -- routes -------------------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "completion")

    async def models(self, request: Request) -> Response:
        model = {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "kvserve"}
        return JSONResponse({"object": "list", "data": [model]}, headers={EXECUTOR_HEADER: NO_EXECUTOR})

    async def health(self, request: Request) -> Response:
        try:
            executors = await self.directory.live_executors()
        except Exception as error:  # Redis down: say so, with a 503
            return JSONResponse(
                {"status": "unavailable", "reason": f"redis: {error}"},
                503,
                headers={EXECUTOR_HEADER: NO_EXECUTOR},
            )
        status = 200 if executors else 503
        body = {
            "status": "ok" if executors else "no executors",
            "executors": [e.executor_id for e in executors],
        }
        return JSONResponse(body, status, headers={EXECUTOR_HEADER: NO_EXECUTOR})

    async def metrics_page(self, request: Request) -> Response:
        loads = [load for _, load in await self.directory.routing_view()]
        return Response(
            self.metrics.render(loads),
            media_type="text/plain; version=0.0.4; charset=utf-8",
            headers={EXECUTOR_HEADER: NO_EXECUTOR},
        )

    # -- one completion request ------------------------------------------------------------------------

    async def _serve(self, request: Request, endpoint: str) -> Response:
        arrival = time.monotonic()
        try:
            routed = await self._route(request, endpoint, arrival)
        except APIError as error:
            self.metrics.requests.labels(endpoint, str(error.status)).inc()
            return _error(error)
        self.metrics.requests.labels(endpoint, "200").inc()
        self.metrics.tokens.labels("prompt").inc(len(routed.request.prompt_token_ids))
        # sent before the response starts, so the executor works while the HTTP machinery sets up
        await self._submit(routed)
        if routed.stream:
            return ReleasingStreamingResponse(
                self._events(routed),
                release=lambda: self._end(routed),
                media_type="text/event-stream",
                headers={EXECUTOR_HEADER: routed.executor.executor_id, "cache-control": "no-cache"},
            )
        try:
            return await self._whole(request, routed)
        finally:
            await self._end(routed)

    async def _submit(self, routed: Routed) -> None:
        """Send to the chosen executor, then count the request in its in-flight count until its first update,
        so concurrent routing decisions (any gateway's) see it before the executor's own load does."""
        await self.client.submit(routed.executor.address, routed.request, routed.timing)
        routed.counted_on = routed.executor.executor_id
        await self._add_inflight(routed.counted_on, routed.prefill_estimate)

    def _uncount(self, routed: Routed) -> None:
        if routed.counted_on is not None:
            # off the token's path
            task = asyncio.create_task(self._add_inflight(routed.counted_on, -routed.prefill_estimate))
            self.background.add(task)
            task.add_done_callback(self.background.discard)
            routed.counted_on = None

    async def _add_inflight(self, executor_id: str, delta: int) -> None:
        try:
            await self.directory.add_inflight(executor_id, delta)
        except Exception as error:  # a routing hint only: the request goes on, the count's TTL heals it
            log.warning("in-flight count of %s not updated: %s", executor_id, error)

    async def _end(self, routed: Routed) -> None:
        self._uncount(routed)
        await self.client.release(routed.executor.address, routed.request.request_id)

    async def _route(self, request: Request, endpoint: str, arrival: float) -> Routed:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise APIError(
                413, f"request body of {length} bytes exceeds {MAX_BODY_BYTES}", code="request_too_large"
            )
        raw = await request.body()
        parse = parse_chat_request if endpoint == "chat" else parse_completion_request
        parsed = parse(raw, [self.config.model_name])
        ids = prompt_token_ids(parsed, self.config.tokenizer)
        if not ids:
            raise APIError(400, "the prompt is empty", param="messages" if endpoint == "chat" else "prompt")
        info, hashes, estimate = await self._choose(ids, exclude=set())
        params = fit_to_context(parsed, len(ids), info.max_model_len)
        generate = protocol.GenerateRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=ids,
            block_hashes=hashes,
            sampling=dataclasses.asdict(params),
        )
        generation = Generation.start(parsed, ids, params.stop, self.config.tokenizer)
        return Routed(
            info,
            generate,
            generation,
            parsed.stream,
            parsed.include_usage,
            arrival,
            prefill_estimate=estimate,
        )

    async def _choose(self, ids: list[int], exclude: set[str]) -> tuple[ExecutorInfo, list[bytes], int]:
        """The executor for a prompt under the routing policy, the prompt's block hashes, and how many of its
        tokens that executor would prefill."""
        block_size = DEFAULT_BLOCK_SIZE  # a guess, checked against what the executors report
        hashes = hash_blocks(ids, block_size)
        view = await self._routing_view(hashes, exclude)
        if view[0][0].block_size != block_size:  # executors with other blocks: hash again, read again
            block_size = view[0][0].block_size
            hashes = hash_blocks(ids, block_size)
            view = await self._routing_view(hashes, exclude)
        view = [(info, load) for info, load in view if info.block_size == block_size]
        policy = self.config.routing_policy
        if policy == "round_robin":
            info, load = view[await self.directory.next_round_robin() % len(view)]
        elif policy == "random":
            info, load = random.choice(view)
        else:
            load = route_request([load for _, load in view], len(ids), block_size)
            info = next(info for info, _ in view if info.executor_id == load.executor_id)
        return info, hashes, prefill_tokens(load, len(ids), block_size)

    async def _routing_view(
        self, hashes: list[bytes], exclude: set[str]
    ) -> list[tuple[ExecutorInfo, Candidate]]:
        try:
            view = await self.directory.routing_view(hashes)
        except Exception as error:
            log.error("redis unreachable: %s", error)
            raise APIError(503, "the executor directory (Redis) is unreachable", "server_error") from None
        view = [(info, load) for info, load in view if info.executor_id not in exclude]
        if not view:
            raise APIError(503, "no executor is available; try again shortly", "server_error")
        return view

    async def _updates(self, routed: Routed):
        """The submitted request's updates; an executor that dies before its first update is replaced."""
        while True:
            executor = routed.executor

            async def alive(executor_id: str = executor.executor_id) -> bool:
                return await self.directory.is_alive(executor_id)

            streamed = False
            try:
                async for update in self.client.updates(
                    executor.address, routed.request.request_id, alive, routed.timing
                ):
                    if not streamed:
                        streamed = True
                        self._uncount(routed)  # from now on the executor's published load counts it
                    self.metrics.tokens.labels("completion").inc(len(update.token_ids))
                    yield update
                return
            except ExecutorGone:
                log.warning(
                    "executor %s stopped answering (request %s)",
                    executor.executor_id,
                    routed.request.request_id,
                )
                if streamed:
                    raise APIError(
                        502, f"executor {executor.executor_id} stopped answering mid-stream", "server_error"
                    ) from None
                routed.tried.add(executor.executor_id)
                self._uncount(routed)
                ids = routed.request.prompt_token_ids
                routed.executor, _, routed.prefill_estimate = await self._choose(ids, routed.tried)
                await self._submit(routed)

    async def _events(self, routed: Routed):
        stream = EventStream(routed.generation, routed.include_usage)
        try:
            async for update in self._updates(routed):
                text = stream.update(
                    update.token_ids, update.logprobs, update.finish_reason, update.num_cached_tokens
                )
                self._observe_first_token(routed, update)
                if text:
                    yield text
                if routed.generation.finished:
                    return  # a stop string matched: leaving the loop aborts the executor request
        except ExecutorRequestError as error:
            yield _executor_error(error).sse_event()
        except APIError as error:
            yield error.sse_event()

    def _observe_first_token(self, routed: Routed, update: protocol.RequestUpdate) -> None:
        if update.token_ids and not routed.first_token_seen:
            routed.first_token_seen = True
            self.metrics.first_token(time.monotonic() - routed.arrival, routed.timing.executor_ttft)

    async def _whole(self, request: Request, routed: Routed) -> Response:
        generation = routed.generation

        async def collect() -> None:
            async for update in self._updates(routed):
                generation.feed(
                    update.token_ids, update.logprobs, update.finish_reason, update.num_cached_tokens
                )
                self._observe_first_token(routed, update)
                if generation.finished:
                    return

        task = asyncio.ensure_future(collect())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    task.cancel()  # the client left: cancelling aborts the request on the executor
                    return Response(status_code=499)
            task.result()
        except ExecutorRequestError as error:
            return _error(_executor_error(error), routed.executor.executor_id)
        except APIError as error:
            return _error(error, routed.executor.executor_id)
        headers = {EXECUTOR_HEADER: routed.executor.executor_id}
        return JSONResponse(response_body(generation), headers=headers)


def build_app(config: GatewayConfig) -> Starlette:
    gateway = Gateway(config)
    routes = [
        Route("/v1/chat/completions", gateway.chat_completions, methods=["POST"]),
        Route("/v1/completions", gateway.completions, methods=["POST"]),
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/health", gateway.health, methods=["GET"]),
        Route("/metrics", gateway.metrics_page, methods=["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await gateway.startup()
        try:
            yield
        finally:
            await gateway.shutdown()

    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind))

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.gateway = gateway
    return app
