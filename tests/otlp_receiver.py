"""A real OTLP/HTTP trace receiver for tests: what a collector would get, parsed into plain dicts.

with OtlpReceiver() as receiver:
    ...  # a process exporting to receiver.endpoint
    spans = receiver.wait_for(lambda spans: any(s["name"] == "x" for s in spans))
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

Span = dict  # name, trace_id, span_id, parent_span_id, service, attributes, start_ns, end_ns


def decode_value(value: AnyValue):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [decode_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: decode_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind) if kind else None


def decode_spans(request: ExportTraceServiceRequest) -> list[Span]:
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: decode_value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    {
                        "name": span.name,
                        "trace_id": span.trace_id.hex(),
                        "span_id": span.span_id.hex(),
                        "parent_span_id": span.parent_span_id.hex(),
                        "service": resource.get("service.name"),
                        "attributes": {a.key: decode_value(a.value) for a in span.attributes},
                        "start_ns": span.start_time_unix_nano,
                        "end_ns": span.end_time_unix_nano,
                        "status_code": span.status.code,
                    }
                )
    return spans


class OtlpReceiver:
    def __init__(self) -> None:
        self._spans: list[Span] = []
        self._changed = threading.Condition()
        self.requests = 0  # export requests accepted
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the name http.server calls
                if self.path != "/v1/traces":
                    self.send_error(404, f"{self.path}: this receiver takes /v1/traces only")
                    return
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                try:
                    request = ExportTraceServiceRequest.FromString(
                        _decompress(body, self.headers.get("Content-Encoding", ""))
                    )
                except (
                    Exception
                ) as error:  # a malformed export is the exporter's bug: answer it, keep serving
                    self.send_error(400, f"not an OTLP trace export: {error}")
                    return
                receiver._add(decode_spans(request))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass  # quiet: pytest output is for failures

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def _add(self, spans: list[Span]) -> None:
        with self._changed:
            self._spans.extend(spans)
            self.requests += 1
            self._changed.notify_all()

    def spans(self) -> list[Span]:
        with self._changed:
            return list(self._spans)

    def wait_for(self, predicate: Callable[[list[Span]], bool], timeout: float = 10.0) -> list[Span]:
        """All spans received, once predicate(spans) holds; AssertionError listing them when it never does."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate(list(self._spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = [s["name"] for s in self._spans]
                    raise AssertionError(f"spans received in {timeout} s did not satisfy the test: {names}")
                self._changed.wait(left)
            return list(self._spans)


def _decompress(body: bytes, encoding: str) -> bytes:
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding == "gzip":
        return gzip.decompress(body)
    if encoding == "deflate":
        return zlib.decompress(body)
    raise ValueError(f"Content-Encoding {encoding!r} not supported")
