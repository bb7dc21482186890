"""compose.yaml, compose.cpu.yaml and the Dockerfile cannot run here (no Docker engine): check them by reading
them, the CPU variant as compose merges it over compose.yaml."""

from __future__ import annotations

import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from executor.engine_config import parse_bytes
from executor.kv.sizing import CPU_DEFAULT_KV_BYTES
from gateway.response_store import store_limits
from kvserve.cli import EXECUTOR_EXTRA, build_parser
from tests.processes import keeps_data_across_a_kill

REPO = Path(__file__).resolve().parents[1]
# what `docker compose -f ... up` reads for each variant, in that order
VARIANTS = {"gpu": ("compose.yaml",), "cpu": ("compose.yaml", "compose.cpu.yaml")}
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


class _Reset:
    """Compose's `!reset`: the key is removed from what the files before set."""


RESET = _Reset()


@dataclass(frozen=True, slots=True)
class Override:
    """Compose's `!override`: the value replaces what the files before set, unmerged."""

    value: object


class ComposeLoader(yaml.SafeLoader):
    """YAML with compose's two merge tags."""


def _override(loader: ComposeLoader, node: yaml.Node) -> Override:
    if isinstance(node, yaml.MappingNode):
        return Override(loader.construct_mapping(node, deep=True))
    if isinstance(node, yaml.SequenceNode):
        return Override(loader.construct_sequence(node, deep=True))
    return Override(loader.construct_scalar(node))


ComposeLoader.add_constructor("!reset", lambda loader, node: RESET)
ComposeLoader.add_constructor("!override", _override)

# a service's sequences that a later file replaces; and those merged by a unique key (compose's merge rules)
REPLACED = {("command",), ("entrypoint",), ("healthcheck", "test")}


def _unique_key(field: str, entry: object) -> object:
    if field == "volumes" and isinstance(entry, str):
        return entry.split(":")[1] if ":" in entry else entry  # the target
    return entry


def merge(base: object, later: object, path: tuple[str, ...] = ()) -> object:
    """`later` laid over `base` as compose lays one file over the one before."""
    if isinstance(later, Override):
        return later.value
    if isinstance(later, dict):
        merged = dict(base) if isinstance(base, dict) else {}
        for key, value in later.items():
            if value is RESET:
                merged.pop(key, None)
            else:
                merged[key] = merge(merged.get(key), value, (*path, key))
        return merged
    if isinstance(later, list) and isinstance(base, list):
        within_service = path[2:] if path[:1] == ("services",) else ()
        if within_service in REPLACED:
            return later
        if within_service in {("volumes",), ("ports",)}:
            field = within_service[0]
            kept = [e for e in base if _unique_key(field, e) not in {_unique_key(field, n) for n in later}]
            return kept + later
        return base + later
    return later


def load_compose(*files: str) -> dict:
    model: dict = {}
    for name in files:
        model = merge(model, yaml.load((REPO / name).read_text(), Loader=ComposeLoader))
    return model


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def compose(request) -> dict:
    return load_compose(*VARIANTS[request.param])


def test_the_merge_follows_composes_rules():
    """The rules the CPU variant relies on, on the examples of compose's merge reference."""
    base, later, merged = (
        yaml.load(text, Loader=ComposeLoader)
        for text in (
            """
            app:
              image: a
              command: [echo, foo]
              dns: [1.1.1.1]
              environment: {FOO: BAR, KEEP: "1"}
              volumes: ["x:/work", "y:/data"]
              deploy: {resources: {reservations: {devices: [{driver: nvidia}]}}}
            """,
            """
            app:
              command: [echo, bar]
              dns: [8.8.8.8]
              environment: {FOO: !reset null, NEW: "2"}
              volumes: ["z:/work"]
              deploy: !reset null
              ports: !override ["8443:443"]
            """,
            """
            app:
              image: a
              command: [echo, bar]
              dns: [1.1.1.1, 8.8.8.8]
              environment: {KEEP: "1", NEW: "2"}
              volumes: ["y:/data", "z:/work"]
              ports: ["8443:443"]
            """,
        )
    )
    assert merge({"services": base}, {"services": later}) == {"services": merged}


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


def test_topology_gateways_behind_one_port_executors_on_their_devices_health_checks(compose):
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
        command = services[name]["command"]
        # a GPU reserved exactly where the executor runs on CUDA: a CPU executor must start on a machine without one
        devices = services[name].get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")
        if command[command.index("--device") + 1] == "cuda":
            assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"], name
        else:
            assert not devices, f"{name} runs on the CPU but reserves {devices}"
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


VALUE_OPTIONS = {"-i", "--index-url", "--extra-index-url"}  # pip options followed by their value


def pip_commands(lines: list[str]) -> list[tuple[list[str], dict[str, str]]]:
    """Each `pip install`: what it installs (its arguments without options), and its options that take a value."""
    commands = []
    for line in lines:
        for command in line.split("&&"):
            words = shlex.split(command)
            if words[:2] == ["pip", "install"] or words[1:4] == ["-m", "pip", "install"]:
                arguments, options = [], {}
                rest = iter(words[words.index("install") + 1 :])
                for word in rest:
                    if word in VALUE_OPTIONS:
                        options[word] = next(rest)
                    elif not word.startswith("-"):
                        arguments.append(word)
                commands.append((arguments, options))
    return commands


def pip_installs(lines: list[str]) -> list[list[str]]:
    """What each `pip install` line installs, as its arguments without options."""
    return [arguments for arguments, _ in pip_commands(lines)]


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


def test_redis_keeps_its_data_on_a_volume_and_requires_the_password(tmp_path):
    compose = load_compose(*VARIANTS["gpu"])  # the CPU variant's Redis is this one (its own test)
    redis_service = compose["services"]["redis"]
    command = [str(word) for word in redis_service["command"]]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert re.fullmatch(r"\$\{KVSERVE_REDIS_PASSWORD:\?[^}]+\}", command[command.index("--requirepass") + 1])
    volume, _, mount = next(v for v in redis_service["volumes"] if v.startswith("redis-data:")).partition(":")
    assert volume in compose["volumes"] and mount == command[command.index("--dir") + 1]
    # the health check authenticates (valkey-cli reads REDISCLI_AUTH) and the command, as shipped, persists
    assert redis_service["environment"]["REDISCLI_AUTH"] == command[command.index("--requirepass") + 1]
    maxmemory = keeps_data_across_a_kill(command, tmp_path)
    # the stored responses, which tenants grow, are bounded well below it (the rest: keys, indexes, limits)
    gateway = build_parser("gateway").parse_args(compose["services"]["gateway"]["command"][1:])
    assert store_limits(gateway).max_total_bytes <= maxmemory // 2


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


def test_the_cpu_variant_is_the_same_stack_with_cpu_executors_and_no_cuda_libraries():
    """`docker compose -f compose.yaml -f compose.cpu.yaml up`: every service, port, volume, environment and health
    check of compose.yaml, but executors on the CPU with its defaults, no GPU reserved, and the engine's image
    built with torch's CPU wheel under a tag of its own."""
    gpu, cpu = load_compose(*VARIANTS["gpu"]), load_compose(*VARIANTS["cpu"])
    assert set(cpu["services"]) == set(gpu["services"]) and cpu["volumes"] == gpu["volumes"]
    assert "nvidia" not in str(cpu)
    engine = {
        name for name, svc in gpu["services"].items() if svc.get("build", {}).get("target") == "executor"
    }
    executors = {name for name in gpu["services"] if name.startswith("executor")}
    assert engine == {"model", *executors} and executors
    for name, service in cpu["services"].items():
        expected = gpu["services"][name]
        changed = set()
        if name in engine:
            changed |= {"build", "image"}
            assert service["build"] == {**expected["build"], "args": {"TORCH_INDEX_URL": CPU_TORCH_INDEX}}
            assert service["image"] != expected["image"], "the CPU image would replace the CUDA one"
        if name in executors:
            changed |= {"command", "environment", "deploy"}
            on_cpu = build_parser("executor").parse_args(service["command"][1:])
            on_gpu = build_parser("executor").parse_args(expected["command"][1:])
            assert (on_cpu.device, on_gpu.device) == ("cpu", "cuda")
            assert (
                parse_bytes(on_cpu.kv_cache_memory) == CPU_DEFAULT_KV_BYTES
            )  # what `kvserve up` gives a CPU
            assert "--gpu-memory-utilization" not in service["command"]
            same = {
                key: value for key, value in vars(on_cpu).items() if key not in {"device", "kv_cache_memory"}
            }
            assert same == {key: vars(on_gpu)[key] for key in same}, name  # id, bind, advertised address, ...
            # the thread count is the shell's or .env's where set there (a bare key), else torch's own
            assert service["environment"] == {**expected["environment"], "OMP_NUM_THREADS": None}
            assert "deploy" not in service
        unchanged = {key: value for key, value in service.items() if key not in changed}
        assert unchanged == {key: value for key, value in expected.items() if key not in changed}, name
    # the Dockerfile takes the index from the build argument; without one it is PyPI's, as before (CUDA wheel)
    executor_stage = stages((REPO / "Dockerfile").read_text())["executor"]
    assert "ARG TORCH_INDEX_URL=https://pypi.org/simple" in executor_stage
    torch_installs = [
        options
        for arguments, options in pip_commands(executor_stage)
        if any(a.startswith("torch") for a in arguments)
    ]
    assert torch_installs == [{"--index-url": "$TORCH_INDEX_URL"}]
