"""Who sees /metrics, and what it shows without Redis: gateway processes over Redis servers of their own (no
executor is needed for either)."""

from __future__ import annotations

import httpx
import pytest

from kvserve.cli import build_parser
from tests.gateway.answers import openai_error
from tests.processes import eventually, free_port
from tests.stacks import serving_stack


def _answers(url: str) -> bool:
    try:
        httpx.get(url)
    except httpx.HTTPError:
        return False
    return True


@pytest.fixture(scope="module")
def gateways(tiny_models, tmp_path_factory):
    """(gateway requiring keys with --metrics-port, its metrics url, one without, their Redis, a key). The last
    test stops that Redis."""
    flags = [("--metrics-port", str(free_port())), ()]
    logs = tmp_path_factory.mktemp("metrics-logs")
    with serving_stack(
        tiny_models["llama"],
        logs,
        executors=0,
        gateways=flags,
        gateway_flags=("--require-api-key",),
        tenants=("acme-corp",),
    ) as stack:
        with_port, without = stack.gateways
        assert eventually(lambda: _answers(with_port.metrics_url), timeout=60), with_port.log_path.read_text()
        yield with_port, with_port.metrics_url, without, stack.server, stack.keys["acme-corp"]


def _not_served(response: httpx.Response) -> str:
    error = openai_error(response, 404)
    assert "acme" not in response.text
    return error["message"]


def test_metrics_port_serves_the_same_registry_and_the_public_port_hides_it(gateways):
    with_port, metrics_url, _, _, key = gateways
    refused = httpx.post(
        f"{with_port.base}/v1/completions", json={"model": "tiny"}, headers={"authorization": f"Bearer {key}"}
    )
    assert refused.status_code == 400  # counted under the key's tenant
    for headers in ({}, {"authorization": f"Bearer {key}"}):
        _not_served(httpx.get(f"{with_port.base}/metrics", headers=headers))
    page = httpx.get(metrics_url)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
    assert (
        'kvserve_requests_total{adapter="",endpoint="completion",status="400",tenant="acme-corp"} 1.0'
        in page.text
    )
    assert "kvserve_kv_blocks_used" in page.text
    assert httpx.get(metrics_url.replace("/metrics", "/v1/models")).status_code == 404  # metrics only


def test_a_gateway_requiring_keys_without_a_metrics_port_serves_no_metrics(gateways):
    _, _, without, _, _ = gateways
    assert "--metrics-port" in _not_served(httpx.get(f"{without.base}/metrics"))


def test_metrics_without_redis_show_the_gateways_own_series(gateways):
    _, metrics_url, _, server, _ = gateways
    server.stop()
    page = httpx.get(metrics_url, timeout=10)
    assert page.status_code == 200, page.text
    assert (
        'kvserve_requests_total{adapter="",endpoint="completion",status="400",tenant="acme-corp"} 1.0'
        in page.text
    )
    assert "# executor series omitted: their stats could not be read from Redis" in page.text
    assert "kvserve_metrics_executor_stats_missing_total 1.0" in page.text


def test_up_takes_the_metrics_flags():
    args = build_parser("up").parse_args(["up", "--metrics-port", "9100", "--metrics-host", "10.0.0.5"])
    assert (args.metrics_port, args.metrics_host) == (9100, "10.0.0.5")
