"""The gateway's HTTP server, which drains on SIGTERM (or Ctrl-C, or SIGHUP) instead of vanishing.

uvicorn on its own closes its listener at the first signal, so requests that arrive while the running ones finish
get "connection refused". Here the listener stays open: new requests get 503 + Retry-After in OpenAI's error
shape (/health: 503 "draining"; /metrics and the liveness probe /health/live still answer), requests in flight
run to their end, and the server stops DRAINED_LINGER_S after none is left or when the grace period is over,
whichever comes first. A second signal stops it at once.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator

import uvicorn
from starlette.responses import JSONResponse

from gateway.api_error import EXECUTOR_HEADER, NO_EXECUTOR, APIError, error_response
from gateway.server.lingering_close import LingeringHttpToolsProtocol

log = logging.getLogger("kvserve.gateway")

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# once the grace period is over, what uvicorn still gives requests in flight before cancelling them
CUT_OFF_S = 1.0
# a scrape during the drain sees it happen; a liveness probe that failed would kill the drain before its end
STILL_SERVED = frozenset({"/metrics", "/health/live"})
# once nothing is in flight, the listener stays open this long more (within the grace period) answering 503: a
# client or load balancer that has not seen the drain yet is told to go elsewhere, not refused a connection, and an
# idle gateway still stops in seconds
DRAINED_LINGER_S = 3.0


class Drain:
    """When draining began, and until when requests in flight may run."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.deadline: float | None = None  # time.monotonic(); None: not draining
        self.drained_at: float | None = None  # time.monotonic() when nothing was in flight any more

    @property
    def started(self) -> bool:
        return self.deadline is not None

    def start(self) -> None:
        self.deadline = time.monotonic() + self.grace_s

    def over(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def lingered(self) -> bool:
        """Drained, and DRAINED_LINGER_S has passed since."""
        return self.drained_at is not None and time.monotonic() >= self.drained_at + DRAINED_LINGER_S

    def retry_after_s(self) -> int:
        """When to try again: this server is gone by the end of the grace period at the latest."""
        return max(1, math.ceil((self.deadline or 0.0) - time.monotonic()))


def refuse_while_draining(app, drain: Drain):
    """ASGI middleware: while draining, every new HTTP request but a scrape is answered 503 on a connection that
    then closes, so a client's next try opens a new one (elsewhere, behind a load balancer)."""

    async def middleware(scope, receive, send) -> None:
        if scope["type"] != "http" or not drain.started or scope["path"] in STILL_SERVED:
            await app(scope, receive, send)
            return
        headers = {"retry-after": str(drain.retry_after_s()), "connection": "close"}
        if scope["path"] == "/health":
            response = JSONResponse(
                {"status": "draining"}, 503, headers={**headers, EXECUTOR_HEADER: NO_EXECUTOR}
            )
        else:
            message = (
                "the server is shutting down and takes no new requests; retry on another server or later"
            )
            response = error_response(
                APIError(503, message, "server_error", code="draining", headers=headers), ""
            )
        await response(scope, receive, send)

    return middleware


class GatewayServer(uvicorn.Server):
    """uvicorn.Server whose signals start a drain; begin_drain() may also be called from another thread."""

    def __init__(self, app, host: str, port: int, grace_s: float) -> None:
        self.drain = Drain(grace_s)
        self.on_drain: list[Callable[[], None]] = []  # run once, when the drain begins
        self._lock = threading.RLock()  # a signal may interrupt its own thread inside
        config = uvicorn.Config(
            refuse_while_draining(app, self.drain),
            http=LingeringHttpToolsProtocol,  # a refusal's answer is read, not lost to a reset
            host=host,
            port=port,
            access_log=False,
            log_config=None,  # uvicorn's own lines go through the same (JSON) handler as ours
            timeout_graceful_shutdown=CUT_OFF_S,
        )
        super().__init__(config)

    def begin_drain(self, why: str) -> None:
        with self._lock:
            if self.drain.started:
                return
            self.drain.start()
        log.info(
            "draining (%s): new requests get 503, %d in flight may run for up to %.0f s",
            why,
            len(self.server_state.tasks),
            self.drain.grace_s,
        )
        for callback in self.on_drain:
            callback()

    def handle_exit(self, sig: int, frame) -> None:
        # in a context of its own: the handler interrupts whatever runs, maybe a request whose ids it would log
        contextvars.Context().run(self._on_signal, signal.Signals(sig).name)

    def _on_signal(self, name: str) -> None:
        if self.drain.started:
            log.info("asked again to stop (%s): stopping now", name)
            self.should_exit = True
            # with nothing in flight the orderly stop is as quick, and closes what the gateway holds
            self.force_exit = bool(self.server_state.tasks)
        else:
            self.begin_drain(name)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Our handlers for the drain's signals while serving, the earlier ones back afterwards, and none of
        uvicorn's raising of the signal again at the end: a drained server returns normally."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        earlier = {sig: signal.signal(sig, self.handle_exit) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in earlier.items():
                signal.signal(sig, handler)

    async def on_tick(self, counter: int) -> bool:
        if self.drain.started and not self.should_exit:
            in_flight = len(self.server_state.tasks)
            if not in_flight and self.drain.drained_at is None:  # what arrives from now on gets a 503 at once
                log.info("drained: no request in flight")
                self.drain.drained_at = time.monotonic()
            if self.drain.lingered():
                self.should_exit = True
            elif self.drain.over():
                if in_flight:
                    log.warning("grace period over: cutting off %d requests still in flight", in_flight)
                self.should_exit = True
        return await super().on_tick(counter)
