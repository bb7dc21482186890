"""compose.yaml and the Dockerfile cannot run here (no Docker engine): check them by reading them."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from executor.cli import build_parser

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "compose.yaml").read_text())


def kvserve_services(compose: dict) -> dict[str, dict]:
    return {name: svc for name, svc in compose["services"].items() if "command" in svc}


def test_every_service_runs_a_real_kvserve_command(compose):
    services = kvserve_services(compose)
    assert {"model", "gateway", "executor-0"} <= set(services)
    for name, service in services.items():
        command = service["command"]
        command = shlex.split(command) if isinstance(command, str) else [str(part) for part in command]
        assert command[0] == "kvserve", name
        try:
            build_parser().parse_args(command[1:])
        except SystemExit as exit_:
            pytest.fail(f"service {name}: `{shlex.join(command)}` does not parse (exit {exit_.code})")
        assert service["build"] == "." and service["environment"]["KVSERVE_REDIS_URL"].startswith(
            "redis://redis:"
        )
        assert "models:/models" in service["volumes"], f"{name} lacks the model volume"


def test_topology_gateways_behind_one_port_executors_on_gpus_health_checks(compose):
    services = compose["services"]
    assert services["redis"]["image"].startswith(("valkey/", "redis"))
    assert services["gateway"]["deploy"]["replicas"] == 2
    published = {name: svc["ports"] for name, svc in services.items() if "ports" in svc}
    # one port for clients, the proxy's; the trace viewer's UI on this machine only
    assert published == {"proxy": ["8000:8000"], "jaeger": ["127.0.0.1:16686:16686"]}
    nginx = (REPO / "deploy" / "nginx.conf").read_text()
    assert "gateway:8000" in nginx and "location = /metrics" in nginx
    executors = [name for name in services if name.startswith("executor")]
    for name in executors:
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
        command = services[name]["command"]
        assert command[command.index("--advertise-address") + 1] == f"tcp://{name}:5600"
    for name in ["redis", "gateway", *executors]:
        assert services[name]["healthcheck"]["test"], f"{name} has no health check"
    assert "models" in compose["volumes"]


def test_dockerfile_installs_the_project_and_copies_every_package():
    dockerfile = (REPO / "Dockerfile").read_text()
    for package in ("executor", "gateway", "kernels", "shared"):
        assert f"COPY {package} {package}" in dockerfile
        assert (REPO / package / "__init__.py").exists()
    assert "pip install --no-cache-dir ." in dockerfile and "KVSERVE_CACHE_DIR=/models" in dockerfile


def test_keys_required_and_traces_exported_to_the_viewer(compose):
    services = kvserve_services(compose)
    assert "--require-api-key" in services["gateway"]["command"]
    # metrics name tenants: a gateway requiring keys serves them only on a port of their own, inside the network
    command = services["gateway"]["command"]
    metrics_port = command[command.index("--metrics-port") + 1]
    assert (
        metrics_port in services["gateway"]["expose"] and metrics_port != command[command.index("--port") + 1]
    )
    for name, service in services.items():
        environment = service["environment"]
        assert environment["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318", name
        assert environment["OTEL_TRACES_EXPORTER"] == "otlp"
    assert compose["services"]["jaeger"]["image"].startswith("jaegertracing/")
