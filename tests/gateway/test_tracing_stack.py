"""One trace across processes (the shared keyed_stack, which exports to the package's OTLP receiver): a client's
traceparent, the gateway's spans and the executor's, collected by a real OTLP/HTTP receiver; and the JSON log lines
that carry the same request and trace ids."""

from __future__ import annotations

import json

import httpx
import pytest

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = "00f067aa0ba902b7"
EXECUTOR_SPANS = {"executor.request", "executor.queue", "executor.prefill", "executor.decode"}


@pytest.fixture(scope="module")
def traced_stack(keyed_stack, otlp_receiver):
    key, _ = keyed_stack.key_store().create("traced-tenant")
    return keyed_stack.gateway, keyed_stack.executor, otlp_receiver, key


def test_one_trace_spans_gateway_and_executor(traced_stack):
    gateway, executor, receiver, key = traced_stack
    headers = {"authorization": f"Bearer {key}", "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"}
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "max_tokens": 5,
        "temperature": 0.5,
        "top_p": 0.9,
        "ignore_eos": True,
    }
    response = httpx.post(f"{gateway.base}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]

    def complete(spans: list[dict]) -> bool:
        names = {s["name"] for s in spans if s["trace_id"] == CLIENT_TRACE}
        return names >= EXECUTOR_SPANS and "chat tiny" in names

    spans = {s["name"]: s for s in receiver.wait_for(complete, timeout=20) if s["trace_id"] == CLIENT_TRACE}
    root = spans["chat tiny"]
    assert root["parent_span_id"] == CLIENT_PARENT and root["service"] == "kvserve-gateway"
    assert (
        root["attributes"]
        | {
            "gen_ai.operation.name": "chat",
            "gen_ai.request.model": "tiny",
            "gen_ai.request.max_tokens": 5,
            "gen_ai.request.temperature": 0.5,
            "gen_ai.request.top_p": 0.9,
            "gen_ai.usage.input_tokens": usage["prompt_tokens"],
            "gen_ai.usage.output_tokens": 5,
            "gen_ai.response.finish_reasons": ["length"],
            "kvserve.tenant": "traced-tenant",
        }
        == root["attributes"]
    )
    assert spans["tokenize"]["parent_span_id"] == root["span_id"]
    route = spans["route"]
    assert route["parent_span_id"] == root["span_id"]
    assert route["attributes"]["kvserve.route.executor"] == executor.id
    assert {"kvserve.route.cached_blocks", "kvserve.route.cost"} <= set(route["attributes"])
    request = spans["executor.request"]
    assert request["service"] == "kvserve-executor" and request["parent_span_id"] == root["span_id"]
    assert request["attributes"]["gen_ai.usage.output_tokens"] == 5
    assert request["attributes"]["kvserve.tenant"] == "traced-tenant"
    for phase in ("executor.queue", "executor.prefill", "executor.decode"):
        assert spans[phase]["parent_span_id"] == request["span_id"]
        assert request["start_ns"] <= spans[phase]["start_ns"] <= spans[phase]["end_ns"] <= request["end_ns"]
    # the tenant is named, its key never
    assert not any(key in json.dumps(s["attributes"]) for s in receiver.spans())


def test_log_lines_carry_request_and_trace_ids(traced_stack):
    gateway, executor, _, key = traced_stack
    headers = {"authorization": f"Bearer {key}", "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"}
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    response = httpx.post(f"{gateway.base}/v1/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    request_id = response.headers["x-request-id"]
    # and one the gateway refuses, before any executor sees it
    refused = httpx.post(f"{gateway.base}/v1/completions", json={**body, "max_tokens": 0}, headers=headers)
    assert refused.status_code == 400

    def lines(path) -> list[dict]:
        return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]

    for path, request in ((gateway.log_path, refused), (executor.log_path, response)):
        records = lines(path)
        assert records and all({"time", "level", "logger", "message", "service"} <= set(r) for r in records)
        request_id = request.headers["x-request-id"]
        mine = [r for r in records if r.get("request_id") == request_id]
        assert mine, f"no log line of {path.name} names request {request_id}"
        assert all(r["trace_id"] == CLIENT_TRACE for r in mine)
