"""The HTTP face of kvserve: OpenAI-compatible routes over executors found in Redis.

The gateway's parts (executor index reader, router, tenancy, ZeroMQ client, metrics) live here for the app's
lifetime; each completion request is served by its endpoint (gateway.endpoints) through the steps every one
shares (gateway.serving.pipeline), which keep nothing between requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.api_error import EXECUTOR_HEADER, NO_EXECUTOR, APIError, error_response
from gateway.endpoints.completions import CompletionEndpoint, chat_completions, text_completions
from gateway.endpoints.lora_adapters import LoRAUpdates
from gateway.endpoints.responses import Responses
from gateway.openai.body import BODY_TIMEOUT_S
from gateway.openai.request_limits import DEFAULT_LIMITS, RequestLimits
from gateway.openai.responses_api import response_not_found
from gateway.prompt.workers import PromptWorkers
from gateway.response_store import DEFAULT_STORE_LIMITS, ResponseStore, StoreLimits
from gateway.routing.backlog import Backlog
from gateway.routing.dispatch import Dispatch
from gateway.routing.executor_client import ExecutorClient
from gateway.routing.index_reader import IndexReader
from gateway.routing.router import Router
from gateway.server.last_resort import LastResort
from gateway.serving.pipeline import Pipeline
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.metrics_listener import MetricsListener
from gateway.telemetry.redis_memory import read_redis_memory
from gateway.tenants.tenancy import Tenancy
from shared.curve_keys import CurveKeys

__all__ = ["GatewayConfig", "build_app"]

log = logging.getLogger("kvserve.gateway")

# a scrape waits this long for the executors' stats, then shows the gateway's own
METRICS_REDIS_TIMEOUT_S = 2.0
# /health waits this long for the first handshake with an executor it has not connected to yet
HEALTH_HANDSHAKE_WAIT_S = 1.0


@dataclass
class GatewayConfig:
    redis_url: str
    model_name: str
    tokenizer: object
    routing_policy: str = "cache_aware"
    require_api_key: bool = False
    queue_timeout: float = 60.0  # seconds a request may wait at the gateway for an executor with room
    # it may serve without keys while none has ever existed: a loopback --host, or --allow-anonymous
    anonymous_allowed: bool = True
    body_timeout_s: float = BODY_TIMEOUT_S  # --body-timeout: a body not in by then gets 408
    # /metrics on a listener of its own; without one, only an open gateway serves it (on its public port)
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    tool_call_parser: str | None = None  # --tool-call-parser: tool_choice "auto" is refused without one
    curve: CurveKeys | None = None  # --curve-keys: this gateway's CURVE pair and the executors' public key
    limits: RequestLimits = DEFAULT_LIMITS  # what one request may ask for (gateway/openai/request_limits.py)
    response_store: StoreLimits = DEFAULT_STORE_LIMITS  # --responses-*: stored responses' TTL and bounds
    runtime_lora_updating: bool = False  # --allow-runtime-lora-updating: operators load and unload adapters


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.index = IndexReader(config.redis_url)
        self.router: Router | None = None
        self.tenancy = Tenancy(self.index.redis, config.require_api_key, config.anonymous_allowed)
        self.client: ExecutorClient | None = None
        self.metrics = GatewayMetrics(config.model_name)
        # parse and tokenize large bodies, and decode large stored responses, off the event loop
        self.prompt_workers = PromptWorkers()
        self.store = ResponseStore(self.index.redis, config.response_store, self.prompt_workers)
        self.pipeline: Pipeline | None = None
        self.chat_completions: CompletionEndpoint | None = None
        self.text_completions: CompletionEndpoint | None = None
        self.responses_endpoint: Responses | None = None
        self.metrics_listener: MetricsListener | None = None
        self.lora_updates = LoRAUpdates(self.index, self.tenancy, config.runtime_lora_updating)

    async def startup(self) -> None:
        await self.tenancy.startup()
        self.client = ExecutorClient(self.config.curve)  # needs the running event loop
        # the router counts what this gateway sent beside what executors publish: the client knows it
        self.router = Router(self.index, self.config.routing_policy, self.client)
        backlog = Backlog(self.router, self.config.queue_timeout)
        dispatch = Dispatch(self.client, self.index, backlog, self.metrics, self.router.policy)
        config = self.config
        self.pipeline = Pipeline(
            config.model_name,
            config.tokenizer,
            self.router,
            self.tenancy,
            self.client,
            self.metrics,
            dispatch,
            config.body_timeout_s,
            config.limits,
        )
        workers = self.prompt_workers
        tokenizer, parser = config.tokenizer, config.tool_call_parser
        self.chat_completions = chat_completions(tokenizer, parser, config.limits, workers)
        self.text_completions = text_completions(tokenizer, config.limits, workers)
        self.responses_endpoint = Responses(tokenizer, parser, config.limits, workers, self.store)
        if self.config.metrics_port is not None:
            metrics_app = Starlette(
                routes=[Route("/metrics", self.metrics_page, methods=["GET"])],
                middleware=[_last_resort(self.metrics)],
            )
            self.metrics_listener = MetricsListener(
                metrics_app, self.config.metrics_host, self.config.metrics_port
            )
            await self.metrics_listener.start()

    async def shutdown(self) -> None:
        if self.metrics_listener is not None:
            await self.metrics_listener.stop()
        await self.tenancy.shutdown()
        self.prompt_workers.close()
        if self.client is not None:
            await self.client.close()
        await self.index.close()

    # -- routes -------------------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        return await self.pipeline.serve(request, self.chat_completions)

    async def completion(self, request: Request) -> Response:
        return await self.pipeline.serve(request, self.text_completions)

    async def responses(self, request: Request) -> Response:
        return await self.pipeline.serve(request, self.responses_endpoint)

    async def stored_response(self, request: Request) -> Response:
        """GET or DELETE /v1/responses/{id}: the caller's tenant's own only; another's reads as absent. Each is
        one request of the caller's limits (a 429 past them), as every endpoint that serves a tenant's data."""
        response_id = request.path_params["response_id"]
        headers = {EXECUTOR_HEADER: NO_EXECUTOR}
        try:
            caller = await self.tenancy.identify(request.headers)
            async with self.tenancy.admitted(caller):
                if request.method == "DELETE":
                    if not await self.store.delete(caller.tenant.name, response_id):
                        raise response_not_found(response_id)
                    body = {"id": response_id, "object": "response.deleted", "deleted": True}
                    return JSONResponse(body, headers=headers)
                stored = await self.store.load_response(caller.tenant.name, response_id)
        except APIError as error:
            return error_response(error, "")
        if stored is None:
            return error_response(response_not_found(response_id), "")
        return Response(stored, media_type="application/json", headers=headers)

    async def models(self, request: Request) -> Response:
        """What the caller's key may use: the base model, then its LoRA adapters that live executors serve."""
        try:
            caller = await self.tenancy.identify(request.headers)
            admission = self.pipeline.admission
            names = admission.models(caller, await admission.catalog())
        except APIError as error:
            return error_response(error, "")
        base = self.config.model_name
        models = [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "kvserve",
                "root": base,
                "parent": None if name == base else base,
            }
            for name in names
        ]
        return JSONResponse({"object": "list", "data": models}, headers={EXECUTOR_HEADER: NO_EXECUTOR})

    async def health(self, request: Request) -> Response:
        try:
            executors = await self.index.live_executors()
        except Exception as error:  # Redis down: say so, with a 503
            return JSONResponse(
                {"status": "unavailable", "reason": f"redis: {error}"},
                503,
                headers={EXECUTOR_HEADER: NO_EXECUTOR},
            )
        # registered in Redis is not enough: an executor that refuses this gateway's handshake cannot serve it
        causes = await asyncio.gather(
            *(self.client.handshake(e.address, HEALTH_HANDSHAKE_WAIT_S) for e in executors)
        )
        refused = {e.executor_id: cause for e, cause in zip(executors, causes, strict=True) if cause}
        executors = [e for e in executors if e.executor_id not in refused]
        status = 200 if executors else 503
        body = {
            "status": "ok" if executors else "no executors",
            "executors": [e.executor_id for e in executors],
        }
        if refused:
            body["refused"] = refused
        return JSONResponse(body, status, headers={EXECUTOR_HEADER: NO_EXECUTOR})

    async def live(self, request: Request) -> Response:
        """Liveness: this process answers HTTP. Unlike /health it asks neither Redis nor the executors, so an
        orchestrator does not restart every gateway while those are down, nor one that is draining."""
        return JSONResponse({"status": "alive"}, headers={EXECUTOR_HEADER: NO_EXECUTOR})

    async def public_metrics(self, request: Request) -> Response:
        """Metrics name every tenant: on the port that serves requests without a key only while the gateway is
        open (no key ever), so every request it counted was the one anonymous tenant's."""
        if self.config.metrics_port is not None:
            reason = "they are served on the metrics port"
        elif not await self.tenancy.serves_anonymously():
            reason = (
                "this gateway requires API keys and metrics name its tenants; start it with --metrics-port"
            )
        else:
            return await self.metrics_page(request)
        return error_response(
            APIError(404, f"GET /metrics is not served here: {reason}", "not_found_error"), ""
        )

    async def metrics_page(self, request: Request) -> Response:
        return Response(
            await self._metrics_text(),
            media_type="text/plain; version=0.0.4; charset=utf-8",
            headers={EXECUTOR_HEADER: NO_EXECUTOR},
        )

    async def _metrics_text(self) -> bytes:
        """The whole stack's series, or while Redis does not answer the gateway's own, saying what is missing."""
        reads = asyncio.gather(self.index.executor_stats(), read_redis_memory(self.index.redis, self.store))
        try:
            stats, memory = await asyncio.wait_for(reads, METRICS_REDIS_TIMEOUT_S)
        except Exception as error:
            log.warning(
                "metrics without the executors' series and Redis's memory: Redis did not answer: %r", error
            )
            self.metrics.redis_memory.snapshot = None
            return self.metrics.render(None)
        self.metrics.redis_memory.snapshot = memory
        return self.metrics.render(stats)


def _last_resort(metrics: GatewayMetrics) -> Middleware:
    endpoints = {
        "/v1/chat/completions": "chat",
        "/v1/completions": "completion",
        "/v1/responses": "responses",
        "/v1/models": "models",
        "/v1/load_lora_adapter": "lora",
        "/v1/unload_lora_adapter": "lora",
        "/health": "health",
        "/health/live": "health",
        "/metrics": "metrics",
    }
    return Middleware(LastResort, metrics=metrics, endpoints=endpoints)


def build_app(config: GatewayConfig) -> Starlette:
    gateway = Gateway(config)
    routes = [
        Route("/v1/chat/completions", gateway.chat, methods=["POST"]),
        Route("/v1/completions", gateway.completion, methods=["POST"]),
        Route("/v1/responses", gateway.responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", gateway.stored_response, methods=["GET", "DELETE"]),
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/v1/load_lora_adapter", gateway.lora_updates.load, methods=["POST"]),
        Route("/v1/unload_lora_adapter", gateway.lora_updates.unload, methods=["POST"]),
        Route("/health", gateway.health, methods=["GET"]),
        Route("/health/live", gateway.live, methods=["GET"]),
        Route("/metrics", gateway.public_metrics, methods=["GET"]),
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

    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error},
        middleware=[_last_resort(gateway.metrics)],
    )
    app.state.gateway = gateway
    return app
