"""Prometheus and Grafana as compose.yaml runs them (no Docker engine here: read, not run): Prometheus scrapes
every gateway's metrics port, Grafana's provisioning finds that Prometheus and the dashboard, and the dashboard is
one Grafana loads, every query of it PromQL, naming only series a gateway's /metrics has. Their labels are checked
against live gateways: tests/gateway/test_dashboard_stack.py."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from tests import grafana_dashboard

REPO = Path(__file__).resolve().parents[1]
GRAFANA = REPO / "deploy" / "grafana"
PROMETHEUS_PORT = 9090  # the prom/prometheus image's --web.listen-address
GRAFANA_PROVISIONING = "/etc/grafana/provisioning"  # where the grafana/grafana image reads it


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "compose.yaml").read_text())


def mounts(service: dict) -> dict[str, Path]:
    """container path -> the file or folder of this repository mounted there"""
    found = {}
    for volume in service.get("volumes", []):
        source, _, rest = volume.partition(":")
        if source.startswith("./"):
            found[rest.split(":")[0]] = REPO / source
    return found


def flag_value(command: list[str], name: str) -> str:
    (value,) = [word.split("=", 1)[1] for word in command if word.startswith(f"{name}=")]
    return value


def test_prometheus_scrapes_every_gateway_replicas_metrics_port(compose):
    services = compose["services"]
    prometheus = services["prometheus"]
    assert prometheus["image"].startswith("prom/prometheus:v")  # a pinned release
    config_path = mounts(prometheus)[flag_value(prometheus["command"], "--config.file")]
    config = yaml.safe_load(config_path.read_text())
    gateway = services["gateway"]["command"]
    metrics_port = int(gateway[gateway.index("--metrics-port") + 1])
    assert str(metrics_port) in services["gateway"]["expose"]
    (job,) = config["scrape_configs"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    # a DNS lookup of the service name: one target per replica (a static target would reach one of them)
    (lookup,) = job["dns_sd_configs"]
    assert lookup["names"] == ["gateway"] and lookup["type"] == "A" and lookup["port"] == metrics_port
    assert services["gateway"]["deploy"]["replicas"] >= 2
    # it keeps its data on a volume of its own
    storage = flag_value(prometheus["command"], "--storage.tsdb.path")
    assert any(
        v.split(":")[0] in compose["volumes"] and v.endswith(f":{storage}") for v in prometheus["volumes"]
    )


def test_grafana_is_provisioned_with_that_prometheus_and_the_dashboard(compose):
    grafana = compose["services"]["grafana"]
    assert grafana["image"].startswith("grafana/grafana:") and grafana["image"].split(":")[1][0].isdigit()
    mounted = mounts(grafana)
    provisioning = mounted[GRAFANA_PROVISIONING]
    assert provisioning == GRAFANA / "provisioning"
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    url = urlsplit(datasource["url"])
    assert datasource["type"] == "prometheus" and url.hostname in compose["services"]
    assert compose["services"][url.hostname]["image"].startswith("prom/") and url.port == PROMETHEUS_PORT
    # the dashboard's datasource variable picks this one by default
    (variable,) = [v for v in grafana_dashboard.load()["templating"]["list"] if v["type"] == "datasource"]
    assert variable["current"]["value"] == datasource["uid"]
    prometheus_config = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())
    assert datasource["jsonData"]["timeInterval"] == prometheus_config["global"]["scrape_interval"]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "kvserve.yml").read_text())["providers"]
    folder = mounted[provider["options"]["path"]]
    assert (folder / grafana_dashboard.DASHBOARD.name).samefile(grafana_dashboard.DASHBOARD)
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (mounted[str(Path(home).parent)] / Path(home).name).samefile(grafana_dashboard.DASHBOARD)
    # the dashboard names tenants: no anonymous viewer, no sign-up, and compose will not start without a password
    environment = grafana["environment"]
    assert (
        environment["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
        and environment["GF_USERS_ALLOW_SIGN_UP"] == "false"
    )
    assert "GF_AUTH_ANONYMOUS_ORG_ROLE" not in environment
    assert re.fullmatch(r"\$\{KVSERVE_GRAFANA_PASSWORD:\?[^}]+\}", environment["GF_SECURITY_ADMIN_PASSWORD"])


def test_the_dashboard_is_one_grafana_loads_every_query_promql():
    dashboard = grafana_dashboard.load()
    assert dashboard["uid"] == "kvserve" and dashboard["schemaVersion"] >= 39
    found = grafana_dashboard.panels(dashboard)
    ids = [panel["id"] for panel in found]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    graphs = [panel for panel in found if panel["type"] != "row"]
    for panel in graphs:
        assert panel["targets"], panel["title"]
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]) and panel["gridPos"]["x"] + panel["gridPos"][
            "w"
        ] <= 24
        for each in (panel, *panel["targets"]):  # by the variable: any Grafana's Prometheus, not one uid
            assert each["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
    queries = grafana_dashboard.queries(dashboard)  # each parsed: fails naming the query that is not PromQL
    named = {name for query in queries for name in query.series}
    # what the issue asks to see, each by the series that shows it
    wanted = {
        "requests and errors by status": "kvserve_requests_total",
        "time to first token": "kvserve_time_to_first_token_seconds_bucket",
        "inter-token latency": "kvserve_inter_token_latency_seconds_bucket",
        "end-to-end latency": "kvserve_e2e_request_latency_seconds_bucket",
        "output tok/s": "kvserve_generation_tokens_total",
        "queue time": "kvserve_queue_time_seconds_bucket",
        "KV blocks used": "kvserve_kv_blocks_used",
        "prefix-cache hit rate": "kvserve_prefix_cache_hit_tokens_total",
        "preemptions": "kvserve_preemptions_total",
        "speculative acceptance": "kvserve_spec_decode_accepted_tokens_total",
        "routing decisions": "kvserve_route_decisions_total",
        # issue 48: each KV tier's blocks, hits by source, bytes copied, pull latency and failed pulls
        "host tier blocks": "kvserve_kv_host_blocks_used",
        "host tier size": "kvserve_kv_host_blocks_total",
        "disk tier blocks": "kvserve_kv_disk_blocks_used",
        "disk tier size": "kvserve_kv_disk_blocks_total",
        **{
            f"cached tokens from the {source}": f"kvserve_kv_{source}_cached_tokens_total"
            for source in ("pool", "host", "disk", "peer")
        },
        "bytes offloaded to host": "kvserve_kv_host_offloaded_bytes_total",
        "bytes offloaded to disk": "kvserve_kv_disk_offloaded_bytes_total",
        "bytes loaded from host": "kvserve_kv_host_loaded_bytes_total",
        "bytes loaded from disk": "kvserve_kv_disk_loaded_bytes_total",
        "bytes pulled": "kvserve_kv_pulled_bytes_total",
        "pull latency": "kvserve_kv_pull_duration_seconds_bucket",
        "pulls": "kvserve_kv_pulls_total",
        "failed pulls": "kvserve_kv_pulls_failed_total",
        # issue 49: Redis's memory against its maxmemory, and the stored responses' against their bound
        "Redis memory": "kvserve_redis_memory_used_bytes",
        "Redis maxmemory": "kvserve_redis_memory_max_bytes",
        "stored responses": "kvserve_responses_stored_bytes",
        "stored responses' bound": "kvserve_responses_max_total_bytes",
    }
    for what, series in wanted.items():
        assert series in named, f"the dashboard shows no {what} ({series})"
    assert any("tenant" in query.labels for query in queries), "no per-tenant panel"


def test_the_dashboard_parser_sees_what_a_query_names():
    query = grafana_dashboard.parse(
        "example",
        'histogram_quantile(0.99, sum by (le) (max by (executor, le) (rate(x_bucket{tenant=~"$tenant"}'
        "[$__rate_interval])))) / on (executor) group_left (model_name) vllm:y",
    )
    assert query.series == {"x_bucket", "vllm:y"}
    assert query.labels == {"le", "executor", "tenant", "model_name"}
    with pytest.raises(AssertionError, match=r"\$undefined has no value"):
        grafana_dashboard.parse("example", "rate(x[$undefined])")
    with pytest.raises(pytest.fail.Exception, match="is not PromQL"):
        grafana_dashboard.parse("example", "sum(rate(x[1m])")


def test_every_series_the_dashboard_queries_is_one_the_gateway_exports():
    """Offline, by name (live gateways and labels: tests/gateway/test_dashboard_stack.py): a renamed or dropped
    metric, an executor's included, fails here rather than as an empty panel."""
    from prometheus_client.parser import text_string_to_metric_families

    from gateway.telemetry.metrics import GatewayMetrics
    from shared.executor_stats import ExecutorStats

    page = GatewayMetrics("tiny").render({"e1": ExecutorStats()}).decode()
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    exported = {
        family.name + suffix
        for family in text_string_to_metric_families(page)
        for suffix in suffixes.get(family.type, ("",))
    }
    for query in grafana_dashboard.queries(grafana_dashboard.load()):
        assert query.series <= exported, f"{query.where}: {sorted(query.series - exported)} not exported"
