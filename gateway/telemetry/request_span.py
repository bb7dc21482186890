"""The gateway's span of one request, with OpenTelemetry's gen_ai attributes; nothing at all when tracing is off.

The span starts at arrival (under the client's traceparent when it sent one), gets `tokenize` and `route` children,
hands its context to the executor inside the ZeroMQ message, and ends with the usage and finish reason. Children
are recorded with explicit start and end times, so no context has to be carried across awaits.
"""

from __future__ import annotations

import time

from shared import tracing

# gen_ai.operation.name per endpoint; a Responses request is a chat turn
OPERATIONS = {"chat": "chat", "completion": "text_completion", "responses": "chat"}


class RequestSpan:
    __slots__ = ("span", "operation")

    def __init__(self, span, operation: str) -> None:
        self.span = span  # None when tracing is off
        self.operation = operation

    @classmethod
    def start(cls, headers, endpoint: str, start_ns: int) -> RequestSpan:
        operation = OPERATIONS[endpoint]
        tracer = tracing.get_tracer()
        if tracer is None:
            return cls(None, operation)
        from opentelemetry.trace import SpanKind

        span = tracer.start_span(
            operation,
            context=tracing.parent_context(headers.get("traceparent")),
            kind=SpanKind.SERVER,
            start_time=start_ns,
            attributes={"gen_ai.operation.name": operation},
        )
        return cls(span, operation)

    def trace_id(self, headers) -> str | None:
        """For log lines: this span's trace, else the client's (tracing off still honours its traceparent)."""
        if self.span is None:
            return tracing.trace_id(headers.get("traceparent"))
        return format(self.span.get_span_context().trace_id, "032x")

    def traceparent(self) -> str | None:
        """What the executor continues the trace from."""
        return None if self.span is None else tracing.traceparent(self.span)

    def child(self, name: str, start_ns: int, attributes: dict) -> None:
        """A finished step of the request, from start_ns to now."""
        if self.span is None:
            return
        from opentelemetry import trace

        tracing.record_span(name, trace.set_span_in_context(self.span), start_ns, time.time_ns(), attributes)

    def describe(self, tenant: str, model: str, max_tokens: int, temperature: float, top_p: float) -> None:
        if self.span is None:
            return
        self.span.update_name(f"{self.operation} {model}")
        self.span.set_attributes(
            {
                "gen_ai.request.model": model,
                "gen_ai.request.max_tokens": max_tokens,
                "gen_ai.request.temperature": temperature,
                "gen_ai.request.top_p": top_p,
                "kvserve.tenant": tenant,
            }
        )

    def finish(
        self,
        status: int,
        error: str | None = None,
        usage: tuple[int, int, int] | None = None,  # prompt, completion, cached tokens
        finish_reason: str | None = None,
        response_id: str | None = None,
        executor_id: str | None = None,
    ) -> None:
        if self.span is None:
            return
        from opentelemetry.trace import Status, StatusCode

        self.span.set_attribute("http.response.status_code", status)
        if usage is not None:
            prompt, completion, cached = usage
            self.span.set_attributes(
                {
                    "gen_ai.usage.input_tokens": prompt,
                    "gen_ai.usage.output_tokens": completion,
                    "kvserve.cached_tokens": cached,
                }
            )
        if finish_reason is not None:
            self.span.set_attribute("gen_ai.response.finish_reasons", [finish_reason])
        if response_id is not None:
            self.span.set_attribute("gen_ai.response.id", response_id)
        if executor_id is not None:
            self.span.set_attribute("kvserve.executor.id", executor_id)
        if error is not None:
            self.span.set_attribute("error.type", str(status))
            self.span.set_status(Status(StatusCode.ERROR, error))
        self.span.end()
