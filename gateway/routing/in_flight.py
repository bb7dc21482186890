"""One admitted request while it is served: what it asks, where routing placed it, what has come back, how it ends.
It lives as long as its HTTP request; the gateway keeps nothing of it afterwards."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.openai.responses import Generation
from gateway.routing.adapters import Adapter
from gateway.routing.executor_client import ExecutorTiming
from gateway.routing.index_reader import ExecutorInfo
from gateway.telemetry.request_span import RequestSpan
from gateway.tenants.tenancy import Caller
from shared import protocol


@dataclass(slots=True)
class Placement:
    """Where the request is: routing's choice, made again when its executor is lost or refuses it as busy."""

    executor: ExecutorInfo
    adapter: Adapter | None = None  # the LoRA adapter it runs under, as its executor serves it
    prefill_estimate: int = 0  # prompt tokens the chosen executor has to prefill, by its cached blocks
    held_s: float = 0.0  # time it waited at the gateway for an executor with room (gateway.routing.backlog)
    counted_on: str | None = None  # the executor whose in-flight count in Redis includes this request
    lost: set[str] = field(default_factory=set)  # executors lost while serving it
    busy_refusals: int = 0  # times executors refused it as busy: its backoff before asking again
    # executors that refused it as busy: skipped while another has room. The gateway counts a tenant's places by
    # what it sent itself, so two executors full of another gateway's requests of the tenant would otherwise bounce
    # it between them without pause until a place freed, past its queue timeout.
    busy_at: set[str] = field(default_factory=set)


@dataclass(slots=True)
class Delivered:
    """What the executors have sent back so far."""

    generations: list[Generation]  # one per choice (n); replaced when it starts again on another executor
    last_token_at: float | None = None  # time.monotonic() of the last update with tokens
    kv_block_seconds: float = 0.0  # what its KV held, as its executor's last update said


@dataclass(slots=True)
class InFlight:
    request: protocol.GenerateRequest
    caller: Caller
    span: RequestSpan
    arrival: float  # time.monotonic() when the HTTP request came in
    reserved_tokens: int  # prompt + n x max_tokens, taken from the caller's tokens-per-minute budget
    stream: bool
    include_usage: bool
    constraint_field: str | None  # OpenAIRequest.constraint_field, which errors about the grammar name
    restart: Callable[[], list[Generation]]  # the choices as they start, for a restart on another executor
    placement: Placement
    delivered: Delivered
    timing: ExecutorTiming = field(default_factory=ExecutorTiming)
    status: int = 200  # what the request's metrics and span report at its end
    error: str | None = None
    endpoint: str = "chat"  # its route, as kvserve_requests_total labels it ("responses" serves as a chat)

    @property
    def adapter_label(self) -> str:
        """Its LoRA adapter's name in the metrics' `adapter` label; "" for the base model."""
        return self.request.lora or ""
