"""An admitted request routed to an executor: the executor chosen (after a wait in the backlog while every one is
full), its sampling fitted to that executor's context, and the message it is sent as."""

from __future__ import annotations

import dataclasses

from gateway.openai.request import fit_to_context
from gateway.openai.request_limits import RequestLimits
from gateway.openai.responses import Generation
from gateway.routing.adapters import Adapter
from gateway.routing.dispatch import Dispatch
from gateway.routing.in_flight import Delivered, InFlight, Placement
from gateway.serving.reading import Reading
from gateway.telemetry.request_span import RequestSpan
from gateway.tenants.tenancy import Caller
from shared import protocol


async def place(
    dispatch: Dispatch,
    limits: RequestLimits,
    tokenizer,
    reading: Reading,
    caller: Caller,
    span: RequestSpan,
    request_id: str,
    arrival: float,
    reserved_tokens: int,
    adapter: Adapter | None = None,
) -> InFlight:
    """The request, as served from now on: where it goes and what it is sent as (adapter: the LoRA adapter its
    model names, None for the base model)."""
    parsed, ids = reading.request, reading.ids
    choice = await dispatch.choose(ids, caller, arrival, span, adapter=adapter)
    # again for the one chosen: executors may differ in their context length
    params = fit_to_context(parsed, len(ids), choice.executor.max_model_len, limits)
    span.describe(caller.tenant.name, parsed.model, params.max_tokens, params.temperature, params.top_p)
    generate = protocol.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=ids,
        block_hashes=choice.block_hashes,
        sampling=dataclasses.asdict(params),
        tenant=caller.tenant,
        traceparent=span.traceparent(),
        priority=parsed.priority,
        kv_peer=choice.kv_peer,
        lora=choice.adapter.name if choice.adapter is not None else None,
    )

    def restart() -> list[Generation]:
        return Generation.start_all(parsed, ids, params.stop, tokenizer)

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
        Placement(choice.executor, choice.adapter, choice.prefill_estimate, choice.held_s),
        Delivered(restart()),
    )
