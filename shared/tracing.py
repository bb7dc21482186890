"""OpenTelemetry tracing, on only when the standard OTEL_* variables ask for it.

Off (the default), nothing of the SDK is imported and every helper here costs nothing; `trace_id` still works,
so logs can carry the trace id a gateway sent even when this process exports no spans. On, spans go through a
BatchSpanProcessor to an OTLP/HTTP exporter, which reads its endpoint, headers and timeouts from the environment.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger("kvserve.tracing")

SHUTDOWN_TIMEOUT_S = 3.0
_EXPORTERS = ("otlp", "console")
# W3C trace context: version-traceid-parentid-flags, lowercase hex; version ff is invalid, and a version-00
# header has exactly these four fields (later versions may append more)
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")

_provider: TracerProvider | None = None
_tracer: Tracer | None = None
_lock = threading.Lock()


def tracing_requested(environ: Mapping[str, str]) -> list[str]:
    """The span exporters the OTEL_* variables ask for ("otlp", "console"); empty when tracing is off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = environ.get("OTEL_TRACES_EXPORTER")
    if names is None:
        endpoints = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        return ["otlp"] if any(environ.get(name) for name in endpoints) else []
    asked = [name.strip().lower() for name in names.split(",")]
    unknown = [name for name in asked if name and name not in (*_EXPORTERS, "none")]
    if unknown:
        log.warning(
            "OTEL_TRACES_EXPORTER: ignoring %s (kvserve knows otlp, console, none)", ", ".join(unknown)
        )
    return [name for name in _EXPORTERS if name in asked]


def configure(service_name: str) -> bool:
    """Install the global tracer provider when the environment asks for traces; whether tracing is on."""
    global _provider, _tracer
    with _lock:
        if _tracer is not None:
            return True
        exporters = tracing_requested(os.environ)
        if not exporters:
            return False
        from opentelemetry import trace
        from opentelemetry.sdk.resources import OTELResourceDetector, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

        # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win over the name this process gives itself
        resource = Resource.create({"service.name": service_name}).merge(OTELResourceDetector().detect())
        # shutdown() bounds the flush at exit; the SDK's own atexit hook would wait up to 30 s
        provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        if "otlp" in exporters:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        if "console" in exporters:
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        trace.set_tracer_provider(provider)
        _provider, _tracer = provider, provider.get_tracer("kvserve")
        log.info("tracing on: %s spans of %s", "+".join(exporters), resource.attributes.get("service.name"))
        return True


def enabled() -> bool:
    return _tracer is not None


def get_tracer() -> Tracer | None:
    return _tracer


def parent_context(traceparent: str | None) -> Context | None:
    """The remote parent a W3C traceparent names, for spans in the caller's trace; None when missing or invalid."""
    if trace_id(traceparent) is None:
        return None
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    context = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def traceparent(span: Span) -> str:
    """The W3C traceparent header value that makes a callee's spans children of this span."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def trace_id(traceparent: str | None) -> str | None:
    """The 32-hex trace id of a valid traceparent, else None; needs no OpenTelemetry, so logs can always use it."""
    if not traceparent:
        return None
    match = _TRACEPARENT.fullmatch(traceparent.strip())
    if match is None:
        return None
    version, trace, parent, _, rest = match.groups()
    if version == "ff" or (version == "00" and rest) or not int(trace, 16) or not int(parent, 16):
        return None
    return trace


def record_span(
    name: str,
    parent: Context,
    start_ns: int,
    end_ns: int,
    attributes: Mapping[str, Any],
    error: str | None = None,
) -> Context:
    """A span recorded after the fact, with explicit times; returns its context, for children. Tracing must be on."""
    from opentelemetry import trace
    from opentelemetry.trace import Status, StatusCode

    span = _tracer.start_span(name, context=parent, start_time=start_ns, attributes=attributes)
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=end_ns)
    return trace.set_span_in_context(span, parent)


def shutdown() -> None:
    """Flush what is queued and stop exporting, within SHUTDOWN_TIMEOUT_S even if the collector hangs."""
    global _provider, _tracer
    with _lock:
        provider, _provider, _tracer = _provider, None, None
    if provider is None:
        return
    # the SDK's shutdown has no overall deadline: run it aside and stop waiting when ours is up
    stopping = threading.Thread(target=provider.shutdown, name="kvserve-tracing-shutdown", daemon=True)
    stopping.start()
    stopping.join(SHUTDOWN_TIMEOUT_S)
    if stopping.is_alive():
        log.warning("tracing: spans not exported within %.0f s of shutdown were dropped", SHUTDOWN_TIMEOUT_S)
