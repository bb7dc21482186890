"""Tracing turns on only when the OTEL_* variables ask, and then exports real OTLP spans in the caller's trace."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from shared import tracing
from tests.otlp_receiver import OtlpReceiver
from tests.processes import REPO

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE}-{PARENT}-01"


@pytest.mark.parametrize(
    ("environ", "exporters"),
    [
        ({}, []),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ""}, []),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, ["otlp"]),  # the exporter's own default endpoint
        ({"OTEL_TRACES_EXPORTER": "console"}, ["console"]),
        ({"OTEL_TRACES_EXPORTER": " OTLP , console"}, ["otlp", "console"]),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, []),
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, []),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, []),
        ({"OTEL_SDK_DISABLED": "TRUE", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, []),
        ({"OTEL_SDK_DISABLED": "false", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ["otlp"]),
    ],
)
def test_tracing_is_on_only_when_the_environment_asks(environ, exporters):
    assert tracing.tracing_requested(environ) == exporters


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (TRACEPARENT, TRACE),
        (f"  {TRACEPARENT}\n", TRACE),
        (f"00-{TRACE}-{PARENT}-00", TRACE),  # not sampled is still a trace
        (f"01-{TRACE}-{PARENT}-01-future-field", TRACE),  # a later version may add fields
        (None, None),
        ("", None),
        ("garbage", None),
        (f"00-{TRACE}-{PARENT}-01-extra", None),  # version 00 has exactly four fields
        (f"ff-{TRACE}-{PARENT}-01", None),
        (f"00-{'0' * 32}-{PARENT}-01", None),
        (f"00-{TRACE}-{'0' * 16}-01", None),
        (f"00-{TRACE.upper()}-{PARENT}-01", None),
        (f"00-{TRACE[:-1]}-{PARENT}-01", None),
    ],
)
def test_trace_id_of_a_traceparent(header, expected):
    assert tracing.trace_id(header) == expected


def test_parent_context_round_trips_a_traceparent_and_refuses_a_bad_one():
    from opentelemetry import trace

    context = tracing.parent_context(TRACEPARENT)
    span = trace.get_current_span(context)
    assert span.get_span_context().is_remote
    assert tracing.traceparent(span) == TRACEPARENT
    assert tracing.parent_context(f"00-{'0' * 32}-{PARENT}-01") is None
    assert tracing.parent_context(None) is None


def _run(script: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=REPO,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_off_by_default_imports_and_installs_nothing():
    result = _run(
        """
        import sys
        from shared import tracing
        assert tracing.configure("kvserve-test") is False
        assert not tracing.enabled() and tracing.get_tracer() is None
        assert tracing.trace_id("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        tracing.shutdown()
        print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


SCRIPT = f"""
    import time
    from shared import tracing
    assert tracing.configure("kvserve-test") and tracing.configure("kvserve-test")  # idempotent
    parent = tracing.parent_context("{TRACEPARENT}")
    start = time.time_ns()
    outer = tracing.record_span("outer", parent, start, start + 2000, {{"tokens": 3, "reasons": ["stop"]}})
    tracing.record_span("inner", outer, start + 1000, start + 2000, {{}}, error="it broke")
    span = tracing.get_tracer().start_span("live", context=parent)
    span.end()
    print(tracing.traceparent(span))
    tracing.shutdown()
    assert not tracing.enabled()
"""


@pytest.mark.parametrize(
    ("env", "service"),
    [
        ({}, "kvserve-test"),
        ({"OTEL_SERVICE_NAME": "renamed", "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip"}, "renamed"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attributes,team=infra"}, "from-attributes"),
    ],
)
def test_spans_reach_an_otlp_receiver_in_the_callers_trace(env, service):
    with OtlpReceiver() as receiver:
        result = _run(SCRIPT, OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, **env)
        assert result.returncode == 0, result.stderr
        spans = {s["name"]: s for s in receiver.wait_for(lambda spans: len(spans) == 3)}
    assert {s["trace_id"] for s in spans.values()} == {TRACE}
    assert {s["service"] for s in spans.values()} == {service}
    outer, inner, live = spans["outer"], spans["inner"], spans["live"]
    assert outer["parent_span_id"] == live["parent_span_id"] == PARENT
    assert inner["parent_span_id"] == outer["span_id"]
    assert outer["end_ns"] - outer["start_ns"] == 2000 and inner["start_ns"] - outer["start_ns"] == 1000
    assert outer["attributes"] == {"tokens": 3, "reasons": ["stop"]}
    assert inner["status_code"] == 2 and outer["status_code"] == 0  # STATUS_CODE_ERROR, UNSET
    assert result.stdout.strip() == f"00-{TRACE}-{live['span_id']}-01"


def test_shutdown_gives_up_on_a_collector_that_never_answers():
    import socket

    with socket.socket() as silent:  # accepts connections (backlog), never reads or replies
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        started = time.monotonic()
        result = _run(
            SCRIPT,
            OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{silent.getsockname()[1]}",
            OTEL_EXPORTER_OTLP_TIMEOUT="30000",
        )
        elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    assert elapsed < tracing.SHUTDOWN_TIMEOUT_S + 10  # the process start, then at most the bound
    assert "dropped" in result.stderr
