"""The HTTP face of kvserve: OpenAI-compatible routes over executors found in Redis.

The gateway's parts (executor directory, router, tenancy, ZeroMQ client, metrics) live here for the app's
lifetime; each completion request is served by gateway.completion, which keeps nothing between requests.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.api_error import APIError
from gateway.backlog import Backlog
from gateway.completion import EXECUTOR_HEADER, NO_EXECUTOR, Completions, error_response
from gateway.executor_client import ExecutorClient
from gateway.executor_directory import ExecutorDirectory
from gateway.metrics import GatewayMetrics
from gateway.router import ROUTING_POLICIES, Router
from gateway.tenancy import Tenancy

__all__ = ["ROUTING_POLICIES", "GatewayConfig", "build_app"]


@dataclass
class GatewayConfig:
    redis_url: str
    model_name: str
    tokenizer: object
    routing_policy: str = "cache_aware"
    require_api_key: bool = False
    queue_timeout: float = 60.0  # seconds a request may wait at the gateway for an executor with room


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.directory = ExecutorDirectory(config.redis_url)
        self.router = Router(self.directory, config.routing_policy)
        self.tenancy = Tenancy(self.directory.redis, config.require_api_key)
        self.client: ExecutorClient | None = None
        self.metrics = GatewayMetrics()
        self.completions: Completions | None = None

    async def startup(self) -> None:
        await self.tenancy.startup()
        self.client = ExecutorClient()  # needs the running event loop
        self.router.unanswered = self.client.unanswered.__getitem__
        self.completions = Completions(
            self.config.model_name,
            self.config.tokenizer,
            self.directory,
            self.router,
            self.tenancy,
            self.client,
            self.metrics,
            Backlog(self.router, self.config.queue_timeout),
        )

    async def shutdown(self) -> None:
        await self.tenancy.shutdown()
        if self.client is not None:
            await self.client.close()
        await self.directory.close()

    # -- routes -------------------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        return await self.completions.serve(request, "chat")

    async def completion(self, request: Request) -> Response:
        return await self.completions.serve(request, "completion")

    async def models(self, request: Request) -> Response:
        try:
            caller = await self.tenancy.identify(request.headers)
        except APIError as error:
            return error_response(error, "")
        models = [
            {"id": name, "object": "model", "created": 0, "owned_by": "kvserve"}
            for name in caller.models([self.config.model_name])
        ]
        return JSONResponse({"object": "list", "data": models}, headers={EXECUTOR_HEADER: NO_EXECUTOR})

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
        return Response(
            self.metrics.render(await self.directory.executor_stats()),
            media_type="text/plain; version=0.0.4; charset=utf-8",
            headers={EXECUTOR_HEADER: NO_EXECUTOR},
        )


def build_app(config: GatewayConfig) -> Starlette:
    gateway = Gateway(config)
    routes = [
        Route("/v1/chat/completions", gateway.chat, methods=["POST"]),
        Route("/v1/completions", gateway.completion, methods=["POST"]),
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
        error = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind)
        return error_response(error, "")

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.gateway = gateway
    return app
