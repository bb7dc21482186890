"""The Grafana dashboard against live gateways (the shared open_stack: two gateways, two executors): every series
its queries select and every label they name is on each gateway's /metrics once requests have gone through, and
the executors' series under vLLM's names carry the same numbers as kvserve's, counting what was served."""

from __future__ import annotations

import httpx
import pytest

from tests import grafana_dashboard
from tests.gateway.answers import Samples, json_events, metric_samples, metric_total
from tests.processes import eventually

# vLLM's name -> kvserve's, for each executor
VLLM_TWINS = {
    "vllm:num_requests_running": "kvserve_running_requests",
    "vllm:num_requests_waiting": "kvserve_waiting_requests",
    "vllm:num_preemptions_total": "kvserve_preemptions_total",
    "vllm:prompt_tokens_total": "kvserve_executor_prompt_tokens_total",
    "vllm:generation_tokens_total": "kvserve_executor_generation_tokens_total",
    "vllm:prefix_cache_queries_total": "kvserve_prefix_cache_queried_tokens_total",
    "vllm:prefix_cache_hits_total": "kvserve_prefix_cache_hit_tokens_total",
    "vllm:spec_decode_num_draft_tokens_total": "kvserve_spec_decode_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total": "kvserve_spec_decode_accepted_tokens_total",
    "vllm:request_queue_time_seconds_count": "kvserve_queue_time_seconds_count",
    "vllm:time_to_first_token_seconds_count": "kvserve_executor_time_to_first_token_seconds_count",
    "vllm:time_to_first_token_seconds_sum": "kvserve_executor_time_to_first_token_seconds_sum",
    "vllm:e2e_request_latency_seconds_count": "kvserve_executor_e2e_request_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_sum": "kvserve_executor_e2e_request_latency_seconds_sum",
}


def served(base: str) -> tuple[int, int]:
    """A completion and a streamed chat through this gateway: (prompt tokens, completion tokens) of both."""
    whole = httpx.post(
        f"{base}/v1/completions",
        json={"model": "tiny", "prompt": "the dashboard's own prompt", "max_tokens": 6, "temperature": 0},
        timeout=60,
    )
    assert whole.status_code == 200, whole.text
    usages = [whole.json()["usage"]]
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "dashboards and their series"}],
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as streamed:
        assert streamed.status_code == 200
        usages += [event["usage"] for event in json_events(streamed.iter_lines()) if event.get("usage")]
    assert len(usages) == 2
    return sum(u["prompt_tokens"] for u in usages), sum(u["completion_tokens"] for u in usages)


@pytest.fixture(scope="module")
def pages(open_stack) -> list[Samples]:
    """Each gateway's /metrics after this module's requests went through every gateway and the executors
    published what they counted (within a second of going idle). Asserts the vLLM-named counters moved by exactly
    what was served."""
    urls = [f"{gateway.base}/metrics" for gateway in open_stack.gateways]
    before = metric_samples(urls[0])
    prompt = completion = 0
    for gateway in open_stack.gateways:
        tokens = served(gateway.base)
        prompt, completion = prompt + tokens[0], completion + tokens[1]
    requests = 2 * len(urls)

    def moved(name: str) -> float:
        return metric_total(metric_samples(urls[0]), name) - metric_total(before, name)

    assert eventually(lambda: moved("vllm:e2e_request_latency_seconds_count") == requests, timeout=5)
    assert moved("vllm:generation_tokens_total") == completion
    assert moved("vllm:prompt_tokens_total") == prompt
    assert moved("vllm:time_to_first_token_seconds_count") == requests
    return [metric_samples(url) for url in urls]


def labels_of(samples: Samples) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for name, labels in samples:
        found.setdefault(name, set()).update(label for label, _ in labels)
    return found


def test_every_dashboard_query_selects_series_each_gateway_exports(pages):
    queries = grafana_dashboard.queries(grafana_dashboard.load())
    for page in pages:
        exported = labels_of(page)
        for query in queries:
            missing = query.series - set(exported)
            assert not missing, f"{query.where}: {sorted(missing)} not on /metrics ({query.expr})"
            known = set().union(*(exported[name] for name in query.series))
            assert query.labels <= known, (
                f"{query.where}: labels {query.labels - known} on none of its series"
            )


def test_vllm_named_series_equal_their_kvserve_twins_per_executor(pages, open_stack):
    page = pages[0]
    executors = {executor.id for executor in open_stack.executors}
    for executor in executors:
        for vllm, kvserve in VLLM_TWINS.items():
            twin = metric_total(page, kvserve, executor=executor)
            assert metric_total(page, vllm, executor=executor, model_name="tiny") == twin, (vllm, executor)
        used = metric_total(page, "kvserve_kv_blocks_used", executor=executor)
        total = metric_total(page, "kvserve_kv_blocks_total", executor=executor)
        for usage in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            assert metric_total(page, usage, executor=executor) == used / total
    # one series per executor: no stale or foreign executor under vLLM's names
    assert {
        dict(labels)["executor"] for name, labels in page if name == "vllm:num_requests_waiting"
    } == executors


def test_redis_memory_is_the_stacks_own(pages, open_stack):
    from gateway.response_store import DEFAULT_STORE_LIMITS, SIZES_KEY

    client = open_stack.redis
    for page in pages:
        assert metric_total(page, "kvserve_redis_memory_used_bytes") > 0
        assert metric_total(page, "kvserve_redis_memory_max_bytes") == int(
            client.config_get("maxmemory")["maxmemory"]
        )
        assert metric_total(page, "kvserve_responses_stored_bytes") == int(
            client.hget(SIZES_KEY, "total") or 0
        )
        assert metric_total(page, "kvserve_responses_max_total_bytes") == DEFAULT_STORE_LIMITS.max_total_bytes
