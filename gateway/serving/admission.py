"""Who may be served, before any executor is asked: the caller's key (from the headers alone), the models it may use
(the base model and its LoRA adapters that live executors serve), the context every executor has, and its tenant's
limits and concurrency, reserved until the request ends.

A caller without a valid key is refused before a byte of its body is read, so it costs next to nothing."""

from __future__ import annotations

import logging
import sys

from starlette.datastructures import Headers
from starlette.requests import Request

from gateway.api_error import APIError
from gateway.openai.request import OpenAIRequest, fit_to_context
from gateway.openai.request_limits import RequestLimits
from gateway.routing.adapters import Adapter
from gateway.routing.router import NO_EXECUTOR_MESSAGE, Catalog, Router
from gateway.tenants.tenancy import Caller, Tenancy

log = logging.getLogger("kvserve.gateway")

# a refused request's unread body up to this is left to uvicorn to discard, keeping the connection; a larger one
# closes it, unparsed, with a lingering close (gateway/server/lingering_close.py), so the client still reads the 401
CLOSE_UNREAD_BODY_BYTES = 64 * 1024


def tenant_of(caller: Caller | None) -> str:
    """The tenant a request's metrics name: none is known until its key is."""
    return caller.tenant.name if caller else "unauthenticated"


def closes_connection(request: Request, caller: Caller | None) -> bool:
    """Whether a refusal closes the connection: keeping it would mean reading a keyless caller's large body only to
    discard it, so a keyless flood of large bodies would cost the gateway what they weigh. Closed, it costs what
    one buffer holds."""
    return caller is None and _unread_body_bytes(request) > CLOSE_UNREAD_BODY_BYTES


def _unread_body_bytes(request: Request) -> int:
    """The body's declared length (chunked: unknown, so counted as large), for a request whose body was not read."""
    if "chunked" in request.headers.get("transfer-encoding", "").lower():
        return sys.maxsize
    length = request.headers.get("content-length", "0")
    return int(length) if length.isdigit() else 0


class Admission:
    def __init__(self, model_name: str, router: Router, tenancy: Tenancy, limits: RequestLimits) -> None:
        self.model_name = model_name
        self.router = router
        self.tenancy = tenancy
        self.limits = limits

    async def identify(self, headers: Headers) -> Caller:
        """From the headers alone: a 401 reads no byte of the body (uvicorn discards a small one and keeps the
        connection; a large one is closed: closes_connection)."""
        return await self.tenancy.identify(headers)

    async def catalog(self) -> Catalog:
        """What the live executors serve now: read once for the request, before its body."""
        return await self.router.catalog()

    def models(self, caller: Caller, catalog: Catalog) -> list[str]:
        """The names the caller may give as `model`, the base model first (the default). Another tenant's
        adapter is not among them, so it is refused as an unknown model is, with the same body."""
        return caller.models([self.model_name], catalog.adapters)

    def adapter(self, model: str, catalog: Catalog) -> Adapter | None:
        """The adapter a `model` the caller may use names; None: the base model (which wins a name clash)."""
        return None if model == self.model_name else catalog.adapters[model]

    async def admit(
        self, caller: Caller, request: OpenAIRequest, ids: list[int], request_id: str, catalog: Catalog
    ) -> int:
        """The tokens reserved for the request (prompt + n x max_tokens) once it is admitted. Before routing: a
        prompt no executor takes costs Redis no routing read, and a caller past its limits hears so on arrival,
        not after a wait in the backlog."""
        if not catalog.max_model_len:
            raise APIError(503, NO_EXECUTOR_MESSAGE, "server_error")
        params = fit_to_context(request, len(ids), catalog.max_model_len, self.limits)
        reserved_tokens = len(ids) + params.n * params.max_tokens  # n choices: n outputs, one prompt
        await self.tenancy.admit(caller, request_id, reserved_tokens)
        return reserved_tokens

    async def withdraw(self, caller: Caller, request_id: str, reserved_tokens: int) -> None:
        """An admitted request that never reached an executor gives its admission back."""
        try:
            await self.tenancy.withdraw(caller, request_id, reserved_tokens)
        # as in Billing.settle: the slot's lease and the bucket's refill heal what this misses
        except Exception as error:
            log.error("giving back tenant %s's limits failed: %s", caller.tenant.name, error)
