"""The executor's updates out to the client: as server-sent events while they come, or as one body once every
choice has finished; a client that leaves meanwhile has its request aborted on the executor."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from gateway.api_error import EXECUTOR_HEADER, REQUEST_ID_HEADER, APIError, error_response
from gateway.openai.responses import Generation
from gateway.routing.dispatch import Dispatch
from gateway.routing.in_flight import InFlight
from gateway.serving.failure import as_api_error, failed

T = TypeVar("T")

DISCONNECT_POLL_S = 0.25


class Reply(Protocol):
    """How a request is answered: ChatReply (chat and text completions) or ResponsesReply (/v1/responses)."""

    def events(self, generations: Sequence[Generation]) -> Any:
        """The stream of events, fed each update; `finished` once every choice has ended."""
        ...

    async def streamed(self, events: Any) -> None:
        """Called once every choice has ended, before the stream's last events go out."""
        ...

    async def whole(self, generations: Sequence[Generation]) -> dict:
        """The whole answer's body."""
        ...

    def error_event(self, events: Any, error: APIError) -> str:
        """The event that ends a stream which failed."""
        ...


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def while_connected(request: Request, work: Awaitable[T]) -> T:
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


class Streaming:
    def __init__(self, dispatch: Dispatch) -> None:
        self.dispatch = dispatch

    def stream(
        self, flight: InFlight, reply: Reply, end: Callable[[InFlight], Awaitable[None]]
    ) -> ReleasingStreamingResponse:
        """The updates as events; `end(flight)` runs however the stream ends."""

        async def release(completed: bool) -> None:
            if (
                not completed and flight.status == 200
            ):  # the client left: a 499, though it had a 200 status line
                flight.status = 499
            await end(flight)

        return ReleasingStreamingResponse(
            self._events(flight, reply),
            release=release,
            media_type="text/event-stream",
            headers={
                EXECUTOR_HEADER: flight.placement.executor.executor_id,
                REQUEST_ID_HEADER: flight.request.request_id,
                "cache-control": "no-cache",
            },
        )

    async def _events(self, flight: InFlight, reply: Reply):
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
                    update.cached_from,
                )
                if stream.finished:  # stored (a Response) before the client hears it is complete
                    await reply.streamed(stream)
                if text:
                    yield text
                if stream.finished:
                    return  # a stop string matched: leaving the loop aborts the executor request
                await self.dispatch.stop_choice(flight, update)
        except Exception as caught:
            error = as_api_error(caught, flight.request.request_id)
            failed(flight, error)
            yield reply.error_event(stream, error)

    async def whole(self, request: Request, flight: InFlight, reply: Reply) -> Response:
        """The answer in one body once every choice has finished; a 499 if the client left first."""

        async def collect() -> None:
            async for update in self.dispatch.updates(flight):
                generations = flight.delivered.generations  # a restart on another executor replaces them
                generations[update.index].feed(
                    update.token_ids,
                    update.logprobs,
                    update.finish_reason,
                    update.num_cached_tokens,
                    update.prompt_logprobs,
                    update.cached_from,
                )
                if all(g.finished for g in generations):
                    return
                await self.dispatch.stop_choice(flight, update)

        try:
            await while_connected(request, collect())
        except ClientGone:
            flight.status = 499
            return Response(status_code=499)
        except Exception as caught:
            error = as_api_error(caught, flight.request.request_id)
        else:
            # the executor that answered: a retry may have replaced the first choice
            headers = {
                EXECUTOR_HEADER: flight.placement.executor.executor_id,
                REQUEST_ID_HEADER: flight.request.request_id,
            }
            return JSONResponse(await reply.whole(flight.delivered.generations), headers=headers)
        failed(flight, error)
        return error_response(error, flight.request.request_id, flight.placement.executor.executor_id)
