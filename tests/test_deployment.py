"""compose.yaml and the Dockerfile cannot run here (no Docker engine): check them by reading them."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from kvserve.cli import EXECUTOR_EXTRA, build_parser
from tests.processes import keeps_data_across_a_kill

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "compose.yaml").read_text())


def kvserve_services(compose: dict) -> dict[str, dict]:
    return {
        name: svc for name, svc in compose["services"].items() if svc.get("command", [""])[0] == "kvserve"
    }


def test_every_service_runs_a_real_kvserve_command(compose):
    services = kvserve_services(compose)
    assert {"model", "gateway", "executor-0"} <= set(services)
    for name, service in services.items():
        command = service["command"]
        command = shlex.split(command) if isinstance(command, str) else [str(part) for part in command]
        assert command[0] == "kvserve", name
        try:
            build_parser(command[1]).parse_args(command[1:])
        except SystemExit as exit_:
            pytest.fail(f"service {name}: `{shlex.join(command)}` does not parse (exit {exit_.code})")
        # the password comes from the environment or .env, never from this file
        url = service["environment"]["KVSERVE_REDIS_URL"]
        assert re.fullmatch(r"redis://:\$\{KVSERVE_REDIS_PASSWORD:\?[^}]+\}@redis:6379/0", url), url
        assert "models:/models" in service["volumes"], f"{name} lacks the model volume"


def test_topology_gateways_behind_one_port_executors_on_gpus_health_checks(compose):
    services = compose["services"]
    assert services["redis"]["image"].startswith(("valkey/", "redis"))
    assert services["gateway"]["deploy"]["replicas"] == 2
    published = {name: svc["ports"] for name, svc in services.items() if "ports" in svc}
    # one port for clients, the proxy's; the trace viewer's, Prometheus's and Grafana's UIs on this machine only
    assert published == {
        "proxy": ["8000:8000"],
        "jaeger": ["127.0.0.1:16686:16686"],
        "prometheus": ["127.0.0.1:9090:9090"],
        "grafana": ["127.0.0.1:3000:3000"],
    }
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
    for package in ("executor", "gateway", "kvkernels", "shared", "bench", "kvserve"):
        assert f"COPY {package} {package}" in dockerfile
        assert (REPO / package / "__init__.py").exists()
    for stage in ("gateway", "executor"):  # each installs the project itself
        assert any(arg.startswith(".") for args in pip_installs(stages(dockerfile)[stage]) for arg in args), (
            stage
        )
    assert "KVSERVE_CACHE_DIR=/models" in dockerfile


def stages(dockerfile: str) -> dict[str, list[str]]:
    """Each build stage's instructions (continuation lines joined, `RUN ` dropped from pip lines), a stage built
    FROM another taking that one's first."""
    text = dockerfile.replace("\\\n", " ")
    found: dict[str, list[str]] = {}
    current: list[str] = []
    for line in (raw.strip() for raw in text.splitlines()):
        if line.startswith("FROM "):
            words = line.split()
            parent = found.get(words[1], [])
            current = found.setdefault(
                words[3] if len(words) > 3 and words[2].upper() == "AS" else words[1], []
            )
            current.extend(parent)
        elif line and not line.startswith("#"):
            current.append(line.removeprefix("RUN ").strip())
    return found


def pip_installs(lines: list[str]) -> list[list[str]]:
    """What each `pip install` line installs, as its arguments without options."""
    installs = []
    for line in lines:
        for command in line.split("&&"):
            words = shlex.split(command)
            if words[:2] == ["pip", "install"] or words[1:4] == ["-m", "pip", "install"]:
                installs.append(
                    [word for word in words[words.index("install") + 1 :] if not word.startswith("-")]
                )
    return installs


def test_the_gateway_target_installs_no_torch_and_the_executor_target_the_engine(compose):
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def pulls_torch(requirements: list[str]) -> bool:
        return any(
            req.split(";")[0].strip().lower().startswith(("torch", "transformers")) for req in requirements
        )

    assert not pulls_torch(project["dependencies"]), "the base install (the gateway's) must not pull torch"
    assert pulls_torch(extras["executor"])
    built = stages((REPO / "Dockerfile").read_text())
    gateway_installs = pip_installs(built["gateway"])
    assert gateway_installs, "the gateway target installs nothing"
    for arguments in gateway_installs:
        for argument in arguments:
            assert "torch" not in argument, argument
            named = argument.partition("[")[2].rstrip("]")
            for extra in filter(None, named.split(",")):
                assert not pulls_torch(extras[extra]), (
                    f"the gateway target installs extra {extra!r}, with torch"
                )
    assert [".[executor]"] in pip_installs(built["executor"])
    targets = {name: svc["build"]["target"] for name, svc in kvserve_services(compose).items()}
    assert targets == {
        "model": "executor",
        "executor-0": "executor",
        "gateway": "gateway",
        "curve-keys": "gateway",
    }
    for service in kvserve_services(compose).values():
        assert service["build"]["context"] == "."
        assert service["build"]["target"] in built


def test_the_missing_dependency_error_names_the_executor_extra():
    """`kvserve executor` without torch names the extra to install: the list it checks is the extra's own."""
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"][
        "executor"
    ]
    names = {re.split(r"[<>=;\[ ]", requirement, maxsplit=1)[0] for requirement in extra}
    assert names == set(EXECUTOR_EXTRA)


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


def test_redis_keeps_its_data_on_a_volume_and_requires_the_password(compose, tmp_path):
    redis_service = compose["services"]["redis"]
    command = [str(word) for word in redis_service["command"]]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert re.fullmatch(r"\$\{KVSERVE_REDIS_PASSWORD:\?[^}]+\}", command[command.index("--requirepass") + 1])
    volume, _, mount = next(v for v in redis_service["volumes"] if v.startswith("redis-data:")).partition(":")
    assert volume in compose["volumes"] and mount == command[command.index("--dir") + 1]
    # the health check authenticates (valkey-cli reads REDISCLI_AUTH) and the command, as shipped, persists
    assert redis_service["environment"]["REDISCLI_AUTH"] == command[command.index("--requirepass") + 1]
    keeps_data_across_a_kill(command, tmp_path)


def test_every_kvserve_health_check_parses(compose):
    checked = 0
    for service in compose["services"].values():
        test = service.get("healthcheck", {}).get("test", [])
        if test[:2] == ["CMD", "kvserve"]:
            build_parser(test[2]).parse_args(test[2:])
            checked += 1
    assert checked >= 1


def test_executors_and_gateways_get_curve_keys_made_once_before_they_start(compose):
    services = compose["services"]
    keys = services["curve-keys"]
    words = [str(w) for w in keys["command"]]
    assert words[:2] == ["kvserve", "curve-keys"] and "--if-missing" in words  # kept across restarts
    out = words[words.index("--out") + 1]
    assert f"curve-keys:{out}" in keys["volumes"]  # writable where it writes
    for name in ("executor-0", "gateway"):
        service = services[name]
        directory = service["environment"]["KVSERVE_CURVE_KEYS"]
        assert directory == out and f"curve-keys:{directory}:ro" in service["volumes"]
        assert service["depends_on"]["curve-keys"]["condition"] == "service_completed_successfully"
