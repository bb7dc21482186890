"""Tenants over real HTTP (the shared keyed_stack, each test's tenants its own): keys, 401 and 429, one budget
shared by two gateway processes, cache isolation, usage billed, a burst waiting behind itself."""

from __future__ import annotations

import functools
import json
import os
import socket
import threading
import time

import httpx
import pytest

from kvserve.redis_server import start_redis_server
from tests.gateway.answers import metric_samples, openai_error
from tests.gateway.http_wire import request
from tests.processes import eventually, run_kvserve

post = functools.partial(httpx.post, timeout=60)

# three full 16-token blocks and then some, whatever the tokenizer does with it
LONG_PROMPT = (
    "The quick brown fox jumps over the lazy dog while the cat watches from the old stone wall. " * 4
)


@pytest.fixture(scope="module")
def tenancy_stack(keyed_stack):
    """(gateway base urls, key store, the first one's metrics url)."""
    gateways = keyed_stack.gateways[:2]
    return [g.base for g in gateways], keyed_stack.key_store(), gateways[0].metrics_url


def test_a_gateway_that_requires_keys_refuses_to_start_while_none_exists():
    server = start_redis_server()
    try:
        args = ("gateway", "--require-api-key", "--redis-url", server.url)
        refused = run_kvserve(*args, env=dict(os.environ), timeout=120)
        assert refused.returncode == 2 and "no API key exists" in refused.stderr
    finally:
        server.stop()


def _complete(base: str, key: str | None, **body) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "ignore_eos": True, **body}
    return post(f"{base}/v1/completions", json=body, headers=headers)


def _assert_openai_error(response: httpx.Response, status: int) -> dict:
    error = openai_error(response, status)
    if status == 429:
        assert error["code"] == "rate_limit_exceeded"
    return error


def test_keys_are_required_and_checked(tenancy_stack):
    (base, _), store, _ = tenancy_stack
    key, record = store.create("acme")
    assert _complete(base, key).status_code == 200
    assert _assert_openai_error(_complete(base, None), 401)["code"] == "invalid_api_key"
    _assert_openai_error(
        _complete(base, None, max_tokens=0), 401
    )  # who calls is checked before what they ask
    _assert_openai_error(_complete(base, key, max_tokens=0), 400)
    assert "API key" in _assert_openai_error(_complete(base, key[:-2] + "xx"), 401)["message"]
    _assert_openai_error(_complete(base, "kvs_0123456789abcdef_nope"), 401)
    _assert_openai_error(httpx.get(f"{base}/v1/models"), 401)
    store.revoke(record.key_id)
    _assert_openai_error(_complete(base, key), 401)
    # health stays open: load balancers and compose's health checks carry no key
    assert httpx.get(f"{base}/health").status_code == 200


def test_a_key_sees_only_its_models(tenancy_stack):
    (base, _), store, _ = tenancy_stack
    limited, _ = store.create("limited", models=["other-model"])
    listing = httpx.get(f"{base}/v1/models", headers={"authorization": f"Bearer {limited}"})
    assert listing.status_code == 200 and listing.json()["data"] == []
    assert _assert_openai_error(_complete(base, limited), 404)["code"] == "model_not_found"
    allowed, _ = store.create("limited", models=["tiny"])
    listing = httpx.get(f"{base}/v1/models", headers={"authorization": f"Bearer {allowed}"})
    assert [m["id"] for m in listing.json()["data"]] == ["tiny"]


def test_requests_per_minute_over_two_gateways(tenancy_stack):
    (first, second), store, _ = tenancy_stack
    key, _ = store.create("rpm-tenant", rpm=2)
    assert _complete(first, key).status_code == 200
    assert _complete(second, key).status_code == 200
    refused = _complete(first, key)
    assert _assert_openai_error(refused, 429)["type"] == "requests"
    assert int(refused.headers["retry-after"]) >= 1
    _assert_openai_error(_complete(second, key), 429)
    assert store.usage("rpm-tenant")["rpm-tenant"]["rejected"] == 2


def test_tokens_per_minute_budget_shared_by_two_gateways(tenancy_stack):
    (first, second), store, _ = tenancy_stack
    probe, _ = store.create("probe")
    prompt_tokens = _complete(first, probe).json()["usage"]["prompt_tokens"]
    per_request = prompt_tokens + 4  # max_tokens 4, ignore_eos: exactly what is reserved and then used
    # room for three requests, not four: the refill over the test (a few tokens a second) cannot add one
    key, _ = store.create("tpm-tenant", tpm=3 * per_request + per_request // 2)
    for base in (first, second, first):
        response = _complete(base, key)
        assert response.status_code == 200 and response.json()["usage"]["total_tokens"] == per_request
    refused = _complete(second, key)
    assert _assert_openai_error(refused, 429)["type"] == "tokens"
    assert int(refused.headers["retry-after"]) >= 1
    usage = store.usage("tpm-tenant")["tpm-tenant"]
    assert usage["requests"] == 3 and usage["prompt_tokens"] == 3 * prompt_tokens
    assert usage["completion_tokens"] == 12


def test_concurrent_requests_limit(tenancy_stack):
    (first, second), store, _ = tenancy_stack
    key, _ = store.create("one-at-a-time", max_concurrency=1)
    started = threading.Event()
    finished = {}

    def long_stream() -> None:
        body = {"model": "tiny", "prompt": "Once", "max_tokens": 200, "ignore_eos": True, "stream": True}
        headers = {"authorization": f"Bearer {key}"}
        with httpx.stream("POST", f"{first}/v1/completions", json=body, headers=headers, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    started.set()
            finished["status"] = r.status_code

    thread = threading.Thread(target=long_stream)
    thread.start()
    try:
        assert started.wait(60)
        refused = _complete(second, key)
        assert _assert_openai_error(refused, 429)["type"] == "concurrent_requests"
    finally:
        thread.join(60)
    assert finished["status"] == 200
    assert _complete(second, key).status_code == 200  # the slot came back when the stream ended


def test_tenants_never_share_cached_prefixes(tenancy_stack):
    (first, second), store, _ = tenancy_stack
    alice, _ = store.create("alice")
    bob, _ = store.create("bob")
    alice_again, _ = store.create("alice")  # another key of the same tenant shares its cache

    def cached(base: str, key: str) -> int:
        response = _complete(base, key, prompt=LONG_PROMPT, max_tokens=1)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(first, alice) == 0
    assert cached(second, bob) == 0  # the same prompt, the same executor: no hit, and no timing to probe
    assert cached(first, alice) >= 48
    assert cached(second, alice_again) >= 48


def _tenant_series(metrics_url: str, tenant: str) -> dict[str, float]:
    """The metrics port's series labelled with only this tenant (and the base model, where they name adapters),
    by name."""
    samples = metric_samples(metrics_url)
    only = {(("tenant", tenant),), (("adapter", ""), ("tenant", tenant))}
    return {name: value for (name, labels), value in samples.items() if labels in only}


def test_usage_bills_cached_and_computed_prompt_tokens_and_kv_block_seconds(tenancy_stack):
    (first, _), store, metrics_url = tenancy_stack
    key, _ = store.create("billed")
    for _ in range(2):  # the second finds the first's full prompt blocks in the prefix cache
        assert _complete(first, key, prompt=LONG_PROMPT).status_code == 200
    usage = store.usage("billed")["billed"]
    assert usage["requests"] == 2 and usage["cached_tokens"] >= 48
    assert usage["computed_prompt_tokens"] == usage["prompt_tokens"] - usage["cached_tokens"]
    by_source = {s: usage[f"cached_tokens_{s}"] for s in ("pool", "host", "disk", "peer")}
    assert by_source == {"pool": usage["cached_tokens"], "host": 0, "disk": 0, "peer": 0}  # no KV tiers here
    assert usage["kv_block_seconds"] > 0
    series = _tenant_series(metrics_url, "billed")
    assert series["kvserve_prompt_tokens_cached_total"] == usage["cached_tokens"]
    assert series["kvserve_prompt_tokens_computed_total"] == usage["computed_prompt_tokens"]
    assert series["kvserve_kv_block_seconds_total"] == pytest.approx(usage["kv_block_seconds"])


def test_a_stream_its_client_leaves_still_bills_what_its_kv_held(tenancy_stack):
    (first, _), store, metrics_url = tenancy_stack
    key, _ = store.create("leaver")
    body = {"model": "tiny", "prompt": "Once", "max_tokens": 900, "ignore_eos": True, "stream": True}
    headers = {"authorization": f"Bearer {key}"}
    with httpx.stream("POST", f"{first}/v1/completions", json=body, headers=headers, timeout=60) as response:
        assert next(line for line in response.iter_lines() if line.startswith("data: {"))
    # the gateway aborts it; the executor's last word comes after the stream has ended, and is billed then
    assert eventually(lambda: store.usage("leaver")["leaver"].get("kv_block_seconds", 0) > 0, timeout=30)
    usage = store.usage("leaver")["leaver"]
    assert usage["requests"] == 1 and usage["completion_tokens"] < 900  # it was aborted, not finished
    assert eventually(lambda: _tenant_series(metrics_url, "leaver")["kvserve_kv_block_seconds_total"] > 0)


def test_a_tenants_burst_waits_behind_itself_not_in_front_of_another_tenant(tenancy_stack):
    """More long prompts than one tenant's waiting places, then another tenant's short one: it starts within a
    step or two of arriving, ahead of most of the burst (first come first served, all of the burst goes first)."""
    (first, _), store, _ = tenancy_stack
    keys = {"burst": store.create("burst")[0], "other": store.create("other")[0]}
    port = int(first.rsplit(":", 1)[1])
    first_tokens: dict[str, float] = {}
    answers: dict[str, bytes] = {}

    def send(tenant: str, prompt: str) -> socket.socket:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True, "stream": True}
        headers = {"authorization": f"Bearer {keys[tenant]}"}
        sock = socket.create_connection(("127.0.0.1", port), timeout=120)
        sock.sendall(
            request("POST", "/v1/completions", json.dumps(body).encode(), close=True, headers=headers)
        )
        return sock

    def read(name: str, sock: socket.socket) -> None:
        data = b""
        with sock:
            while chunk := sock.recv(65536):
                data += chunk
                if b"data: {" in data:
                    first_tokens.setdefault(name, time.monotonic())
        answers[name] = data

    # the whole burst is written before the other tenant's request: arrival order is certain
    burst = {f"b{i}": send("burst", f"{i} " + LONG_PROMPT * 8) for i in range(32)}
    readers = [threading.Thread(target=read, args=item) for item in burst.items()]
    for reader in readers:
        reader.start()
    try:
        assert eventually(lambda: first_tokens, timeout=120)  # the burst is being prefilled
        sent = time.monotonic()
        read("other", send("other", "Hello"))
    finally:
        for reader in readers:
            reader.join(120)
    assert all(answer.startswith(b"HTTP/1.1 200") for answer in answers.values()) and len(first_tokens) == 33
    # of the burst's prompts still waiting when the other tenant's arrived (those begun while the test noticed the
    # first token and sent it came first, rightly), most start after it: first come first served, all would
    waiting = [name for name in burst if first_tokens[name] >= sent]
    ahead = sum(first_tokens[name] < first_tokens["other"] for name in waiting)
    assert ahead <= len(waiting) // 2, (
        f"{ahead} of the {len(waiting)} waiting prompts started before the other's"
    )
