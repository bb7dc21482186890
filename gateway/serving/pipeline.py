"""One completion request, from its arrival to its end, whichever endpoint it came to: who calls, what they ask,
where it goes, the tokens back.

Stateless between requests: each one checks the caller's key from its headers before reading its body
(admission.py), has its body read into a prompt by its endpoint (reading.py, gateway.endpoints), is admitted
against the caller's limits, reads the live executors, their cached prefixes and loads from Redis and is routed
(placement.py), is streamed back from the chosen executor over ZeroMQ (streaming.py; sent elsewhere if that executor
is busy, or dies before the client has received anything: gateway.routing.dispatch), and is settled (billing.py),
recorded and forgotten. While every executor's queue is full it waits at the gateway (gateway.routing.backlog).
What it holds while served is an InFlight (gateway/routing/in_flight.py).
"""

from __future__ import annotations

import logging
import time
import uuid

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from gateway.api_error import APIError, error_response
from gateway.openai.request_limits import DEFAULT_LIMITS, RequestLimits
from gateway.routing.adapters import Adapter
from gateway.routing.dispatch import Dispatch
from gateway.routing.executor_client import ExecutorClient
from gateway.routing.in_flight import InFlight
from gateway.routing.router import Router
from gateway.serving.admission import Admission, closes_connection, tenant_of
from gateway.serving.billing import Billing, usage_of
from gateway.serving.failure import as_api_error, failed
from gateway.serving.placement import place
from gateway.serving.reading import Endpoint, Reading, read
from gateway.serving.streaming import ClientGone, Streaming, while_connected
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.request_span import RequestSpan
from gateway.tenants.tenancy import Caller, Tenancy
from shared import logs

log = logging.getLogger("kvserve.gateway")


class Pipeline:
    """Serves each endpoint's requests with the gateway's parts."""

    def __init__(
        self,
        model_name: str,
        tokenizer,
        router: Router,
        tenancy: Tenancy,
        client: ExecutorClient,
        metrics: GatewayMetrics,
        dispatch: Dispatch,
        body_timeout_s: float,
        limits: RequestLimits = DEFAULT_LIMITS,
    ) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.dispatch = dispatch
        self.body_timeout_s = body_timeout_s
        self.limits = limits
        self.admission = Admission(model_name, router, tenancy, limits)
        self.streaming = Streaming(dispatch)
        self.billing = Billing(tenancy, metrics, client, dispatch)

    async def serve(self, request: Request, endpoint: Endpoint) -> Response:
        arrival = time.monotonic()
        request_id = uuid.uuid4().hex
        span = RequestSpan.start(request.headers, endpoint.name, time.time_ns())
        # this request's task (and tasks it starts) log with its ids; the binding ends with the task
        logs.bind(request_id, span.trace_id(request.headers))
        caller = adapter = None
        try:
            caller = await self.admission.identify(request.headers)
            catalog = await self.admission.catalog()
            models = self.admission.models(caller, catalog)
            reading = await read(request, endpoint, caller, models, span, self.body_timeout_s)
            adapter = self.admission.adapter(reading.request.model, catalog)
            reserved_tokens = await self.admission.admit(
                caller, reading.request, reading.ids, request_id, catalog
            )
            flight = await self._route(
                request, reading, caller, span, request_id, arrival, reserved_tokens, adapter
            )
        except ClientDisconnect:  # the client left while sending its body: no one to answer, nothing broke
            log.info("client disconnected while sending its request body")
            self.metrics.requests.labels(tenant_of(caller), endpoint.name, "499", _label(adapter)).inc()
            span.finish(499, "client disconnected")
            return Response(status_code=499)
        except Exception as caught:
            error = endpoint.refusal(as_api_error(caught, request_id))
            log.info("request refused (%d, tenant %s): %s", error.status, tenant_of(caller), error.message)
            status = str(error.status)
            self.metrics.requests.labels(tenant_of(caller), endpoint.name, status, _label(adapter)).inc()
            span.finish(error.status, error.message)
            response = error_response(error, request_id)
            if closes_connection(request, caller):
                response.headers["connection"] = "close"
            return response
        flight.endpoint = endpoint.name
        try:
            # sent before the response starts, so the executor works while the HTTP machinery sets up
            await self.dispatch.submit(flight)
        except Exception as caught:
            error = as_api_error(caught, request_id)
            failed(flight, error)
            await self._end(flight)
            return error_response(error, request_id)
        except BaseException:
            await self._end(flight)
            raise
        if flight.stream:
            return self.streaming.stream(flight, reading.reply, self._end)
        try:
            return await self.streaming.whole(request, flight, reading.reply)
        finally:
            await self._end(flight)

    async def _route(
        self,
        request: Request,
        reading: Reading,
        caller: Caller,
        span: RequestSpan,
        request_id: str,
        arrival: float,
        reserved_tokens: int,
        adapter: Adapter | None,
    ) -> InFlight:
        routed = place(
            self.dispatch,
            self.limits,
            self.tokenizer,
            reading,
            caller,
            span,
            request_id,
            arrival,
            reserved_tokens,
            adapter,
        )
        try:  # it may wait in the backlog: a client that leaves meanwhile takes it out
            return await while_connected(request, routed)
        except Exception as caught:  # it never reached an executor: its admission is given back
            await self.admission.withdraw(caller, request_id, reserved_tokens)
            if isinstance(caught, ClientGone):
                raise APIError(
                    499, "the client disconnected while its request waited for an executor"
                ) from None
            raise

    async def _end(self, flight: InFlight) -> None:
        """However the request ended: free it on the executor, record it, settle the caller's budget."""
        await self.dispatch.release(flight)
        usage = usage_of(flight)
        generation = flight.delivered.generations[0]
        self.metrics.requests.labels(
            flight.caller.tenant.name, flight.endpoint, str(flight.status), flight.adapter_label
        ).inc()
        self.metrics.e2e.observe(time.monotonic() - flight.arrival)
        flight.span.finish(
            flight.status,
            flight.error,
            usage,
            generation.finish_reason,
            generation.id,
            flight.placement.executor.executor_id,
        )
        await self.billing.settle(flight, usage)


def _label(adapter: Adapter | None) -> str:
    """The metrics' `adapter` label: an adapter's name once the request's model is known to name one, else ""."""
    return adapter.name if adapter is not None else ""
