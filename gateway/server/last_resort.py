"""The last line between a bug and a client: an exception any route lets through becomes a 500 in OpenAI's shape,
logged with its traceback and counted. Starlette's own handler would answer plain text and re-raise, and uvicorn
then closes the connection, dropping requests pipelined behind it on a keep-alive connection."""

from __future__ import annotations

import logging
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.api_error import error_response, internal_error
from gateway.telemetry.metrics import GatewayMetrics

log = logging.getLogger("kvserve.gateway")


class LastResort:
    """ASGI middleware. `endpoints` maps paths to the endpoint label of kvserve_requests_total; others count as
    "other", so a client choosing paths cannot choose label values."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, endpoints: dict[str, str]) -> None:
        self.app = app
        self.metrics = metrics
        self.endpoints = endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            request_id = uuid.uuid4().hex
            log.exception(
                "%s %s failed unexpectedly", scope["method"], scope["path"], extra={"request_id": request_id}
            )
            self.metrics.requests.labels(
                "unauthenticated", self.endpoints.get(scope["path"], "other"), "500", ""
            ).inc()
            # once the status is out, uvicorn closes the connection instead, telling the client it was cut
            if not started:
                await error_response(internal_error(request_id), request_id)(scope, receive, send)
