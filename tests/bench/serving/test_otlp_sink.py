"""The discarding OTLP sink the trace-cost soak exports to: OpenTelemetry's own exporter must take its answer as
success, or the services would retry and the soak would measure retries."""

from __future__ import annotations

import threading
from http.server import ThreadingHTTPServer

from bench.serving.otlp_sink import Sink


def test_the_otlp_exporter_counts_the_sinks_answer_as_success():
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExportResult

    server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        before = Sink.exports
        provider = TracerProvider()
        span = provider.get_tracer("test").start_span("probe")
        span.end()
        exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{server.server_port}/v1/traces")
        assert exporter.export([span]) == SpanExportResult.SUCCESS
        assert Sink.exports == before + 1 and Sink.received_bytes > 0
    finally:
        server.shutdown()
        server.server_close()
