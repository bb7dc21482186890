"""A traced request's spans, recorded when it ends: its whole life on this executor and a child per phase.

Spans carry explicit start and end times taken on the request as it moved (arrival, first scheduled, first token,
finish), so the engine's step loop makes no OpenTelemetry call at all; the phases tile the request's span.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from shared import tracing
from shared.cache_sources import by_source
from shared.tenant import ANONYMOUS_TENANT

if TYPE_CHECKING:
    from opentelemetry.context import Context

    from executor.request import Request


def record_request_spans(r: Request, parent: Context, executor_id: str, reason: str) -> None:
    """executor.request in the gateway's trace, with a child per phase that began (queue, prefill, decode),
    each ending where the next began or where the request ended."""
    end = r.finished_ns or time.time_ns()  # a request that failed may never have reached the engine's end
    inputs = {
        "gen_ai.usage.input_tokens": r.num_prompt_tokens,
        "kvserve.cached_tokens": max(0, r.num_cached_tokens),
        # where they came from: the pool, a KV tier below it, a peer (all four, summing to the above)
        **{
            f"kvserve.cached_tokens.{source}": tokens
            for source, tokens in by_source(r.num_cached_tokens, r.cached_from).items()
        },
    }
    outputs = {
        "gen_ai.usage.output_tokens": r.num_output_tokens,
        "kvserve.preemptions": r.num_preemptions,
    }
    spec = {
        "kvserve.spec_decode.draft_tokens": r.num_draft_tokens,
        "kvserve.spec_decode.accepted_tokens": r.num_accepted_tokens,
    }
    if r.num_draft_tokens:
        spec["kvserve.spec_decode.acceptance_rate"] = r.num_accepted_tokens / r.num_draft_tokens
    attributes = {
        "kvserve.executor.id": executor_id,
        "kvserve.request.id": r.request_id,
        # the gateway's span names the anonymous tenant; here, as ever, only a key's tenant is named
        **({"kvserve.tenant": r.tenant.name} if r.tenant != ANONYMOUS_TENANT else {}),
        **inputs,
        **outputs,
        **spec,
        "gen_ai.response.finish_reasons": [reason],
    }
    error = "internal error in the executor" if reason == "error" else None
    request_span = tracing.record_span("executor.request", parent, r.arrival_ns, end, attributes, error)
    scheduled, first_token = r.first_scheduled_ns, r.first_token_ns
    tracing.record_span("executor.queue", request_span, r.arrival_ns, scheduled or end, {})
    if scheduled:
        tracing.record_span("executor.prefill", request_span, scheduled, first_token or end, inputs)
    if first_token:
        tracing.record_span("executor.decode", request_span, first_token, end, {**outputs, **spec})
