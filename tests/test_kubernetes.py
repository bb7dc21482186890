"""deploy/kubernetes/ cannot run here (no cluster): each overlay is rendered with `kubectl kustomize`, validated
against the Kubernetes API's schemas, and read: its kvserve commands parse, its probes reach what a real gateway
serves, its secrets stay out of it, and its grace periods let streams finish."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.response_store import store_limits
from kvserve.cli import build_parser, main
from kvserve.redis_server import start_redis_server
from tests.processes import REPO, GatewayProcess, eventually, free_port, keeps_data_across_a_kill

KUBERNETES = REPO / "deploy" / "kubernetes"
OVERLAYS = ("gpu", "cpu")
KUBERNETES_VERSION = "1.32.0"  # the schemas validated against (kubectl 1.32's own API)
WORKLOADS = ("Deployment", "StatefulSet", "Job", "DaemonSet")
# what the kubelet's downward API and Secrets would give the variables: enough to expand $(VAR) the same way
SAMPLE_FIELDS = {"metadata.name": "kvserve-executor-0", "metadata.namespace": "kvserve"}
SAMPLE_SECRET = "0123abcd"


def render(overlay: str) -> list[dict]:
    return render_directory(KUBERNETES / "overlays" / overlay)


def render_directory(kustomization: Path) -> list[dict]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed here: the overlays cannot be rendered (kubectl kustomize)")
    done = subprocess.run(
        ["kubectl", "kustomize", str(kustomization)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> tuple[str, list[dict]]:
    return request.param, render(request.param)


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def pod_specs(docs: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in docs if d["kind"] in WORKLOADS}


def containers(spec: dict) -> list[dict]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def container(docs: list[dict], workload: str, name: str) -> dict:
    return next(c for c in pod_specs(docs)[workload]["containers"] if c["name"] == name)


def environment(container: dict) -> dict[str, str]:
    """The container's variables as the kubelet would set them, $(VAR) of earlier ones expanded."""
    values: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            values[var["name"]] = expand(var["value"], values, f"env {var['name']}")
        elif "fieldRef" in var["valueFrom"]:
            values[var["name"]] = SAMPLE_FIELDS[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            assert "secretKeyRef" in var["valueFrom"], var
            values[var["name"]] = SAMPLE_SECRET
    return values


def expand(text: str, values: dict[str, str], where: str) -> str:
    """Kubernetes leaves a $(VAR) it does not know as it is: that would reach kvserve as a literal."""

    def one_variable(match: re.Match) -> str:
        assert match.group(1) in values, f"{where}: $({match.group(1)}) is not defined before it is used"
        return values[match.group(1)]

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one_variable, text)


def argv(container: dict) -> list[str]:
    values = environment(container)
    words = [*container.get("command", []), *container.get("args", [])]
    return [expand(str(word), values, container["name"]) for word in words]


def parse_kvserve(words: list[str], where: str):
    assert words[0] == "kvserve", where
    try:
        return build_parser(words[1]).parse_args(words[1:])
    except SystemExit as exit_:
        pytest.fail(f"{where}: `{shlex.join(words)}` does not parse (exit {exit_.code})")


def flag(words: list[str], name: str) -> str:
    return words[words.index(name) + 1]


def test_each_overlay_validates_against_the_kubernetes_api_schemas(overlay):
    validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (the test extra has it)"
    )
    _, docs = overlay
    for doc in docs:
        validate.validate(doc, KUBERNETES_VERSION, strict=True)  # raises naming the field


def test_every_kvserve_command_and_exec_probe_parses(overlay):
    _, docs = overlay
    parsed = set()
    for workload, spec in pod_specs(docs).items():
        for each in containers(spec):
            words = argv(each)
            if words and words[0] == "kvserve":
                args = parse_kvserve(words, f"{workload}/{each['name']}")
                parsed.add(args.command)
            probe = each.get("readinessProbe", {}).get("exec", {}).get("command", [])
            if probe[:1] == ["kvserve"]:  # runs with the container's environment
                parse_kvserve(probe, f"{workload}/{each['name']} readiness")
                parsed.add(probe[1])
    assert {"gateway", "executor", "model", "ready"} <= parsed


def test_images_are_the_dockerfile_targets_set_by_the_overlay(overlay):
    name, docs = overlay
    dockerfile = (REPO / "Dockerfile").read_text()
    wanted = yaml.safe_load((KUBERNETES / "overlays" / name / "kustomization.yaml").read_text())["images"]
    images = {image["name"]: f"{image['newName']}:{image['newTag']}" for image in wanted}
    for target in ("gateway", "executor"):
        assert f" AS {target}\n" in dockerfile
        assert f"kvserve-{target}" in images
    for workload, spec in pod_specs(docs).items():
        for each in containers(spec):
            words = argv(each)
            if words[:1] != ["kvserve"]:
                continue
            # the gateway's image has no torch: only `kvserve gateway` and `kvserve model wait` run there
            gateway_side = words[1] == "gateway" or words[1:3] == ["model", "wait"]
            target = "gateway" if gateway_side else "executor"
            assert each["image"] == images[f"kvserve-{target}"], f"{workload}/{each['name']}"


def test_executors_advertise_their_own_pod_dns_name_behind_a_headless_service(overlay):
    _, docs = overlay
    statefulset = one(docs, "StatefulSet", "kvserve-executor")
    service = one(docs, "Service", statefulset["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    assert (
        service["spec"]["selector"].items() <= statefulset["spec"]["template"]["metadata"]["labels"].items()
    )
    executor = container(docs, "kvserve-executor", "executor")
    words = argv(executor)
    pod = SAMPLE_FIELDS["metadata.name"]
    assert flag(words, "--executor-id") == pod
    (port,) = service["spec"]["ports"]
    assert flag(words, "--advertise-address") == (
        f"tcp://{pod}.{service['metadata']['name']}.{SAMPLE_FIELDS['metadata.namespace']}.svc:{port['port']}"
    )
    bind_port = int(flag(words, "--bind").rsplit(":", 1)[1])
    assert {"name": port["targetPort"], "containerPort": bind_port} in executor["ports"]
    # the readiness probe names this executor: it inherits KVSERVE_EXECUTOR_ID, the id it registers under
    assert environment(executor)["KVSERVE_EXECUTOR_ID"] == flag(words, "--executor-id")
    assert executor["readinessProbe"]["exec"]["command"] == ["kvserve", "ready"]


def test_grace_periods_let_streams_finish_before_the_kubelet_kills(overlay):
    _, docs = overlay
    for workload, name in (("kvserve-executor", "executor"), ("kvserve-gateway", "gateway")):
        spec = pod_specs(docs)[workload]
        each = container(docs, workload, name)
        drain = float(flag(argv(each), "--shutdown-grace-period"))
        pre_stop = each.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        waited = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
        assert spec["terminationGracePeriodSeconds"] > waited + drain, workload


def test_gateways_are_replicated_autoscaled_and_never_all_disrupted(overlay):
    _, docs = overlay
    deployment = one(docs, "Deployment", "kvserve-gateway")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["replicas"] >= 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    hpa = one(docs, "HorizontalPodAutoscaler", "kvserve-gateway")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "kvserve-gateway",
    }
    assert hpa["spec"]["minReplicas"] >= 2
    budget = one(docs, "PodDisruptionBudget", "kvserve-gateway")
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert budget["spec"]["minAvailable"] >= 1
    service = one(docs, "Service", "kvserve-gateway")
    assert service["spec"]["selector"].items() <= labels.items()
    ports = {p["name"] for p in container(docs, "kvserve-gateway", "gateway")["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports


def selects(selector: dict, labels: dict) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In"
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


def test_network_policies_guard_executors_redis_and_the_gateways_metrics_port(overlay):
    _, docs = overlay
    labels = {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for d in docs
        if d["kind"] in WORKLOADS
    }
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}

    def admitted(policy: dict, port: int) -> set[str]:
        """The workloads whose pods this policy lets in on port (from any namespace: a peer naming one admits
        none of kvserve's)."""
        return {
            name
            for rule in policy["ingress"]
            for peer in rule.get("from", [])
            for name, pod in labels.items()
            if "namespaceSelector" not in peer
            and selects(peer["podSelector"], pod)
            and port in {p["port"] for p in rule["ports"]}
        }

    def open_to_all(policy: dict, port: int) -> bool:
        return any(
            "from" not in rule and port in {p["port"] for p in rule["ports"]} for rule in policy["ingress"]
        )

    executor, redis = policies["kvserve-executor"], policies["kvserve-redis"]
    assert selects(executor["podSelector"], labels["kvserve-executor"]) and executor["policyTypes"] == [
        "Ingress"
    ]
    assert admitted(executor, 5600) == {"kvserve-gateway"}
    assert selects(redis["podSelector"], labels["kvserve-redis"])
    assert admitted(redis, 6379) == {"kvserve-gateway", "kvserve-executor"}
    assert not any(
        open_to_all(policy, port) for policy, port in ((executor, 5600), (executor, 5601), (redis, 6379))
    )
    # the gateways' API port is open; their metrics port (it names tenants) admits Prometheus's pods alone
    gateway = policies["kvserve-gateway"]
    gateway_args = argv(container(docs, "kvserve-gateway", "gateway"))
    api_port, metrics_port = (int(flag(gateway_args, name)) for name in ("--port", "--metrics-port"))
    assert selects(gateway["podSelector"], labels["kvserve-gateway"]) and gateway["policyTypes"] == [
        "Ingress"
    ]
    assert open_to_all(gateway, api_port) and not open_to_all(gateway, metrics_port)
    assert admitted(gateway, metrics_port) == set()
    (peer,) = [peer for rule in gateway["ingress"] if "from" in rule for peer in rule["from"]]
    prometheus = {
        "app.kubernetes.io/name": "prometheus",
        "app.kubernetes.io/instance": "kube-prometheus-stack",
    }
    assert selects(peer["podSelector"], prometheus) and not selects(
        peer["podSelector"], labels["kvserve-gateway"]
    )
    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    assert {p["port"] for rule in gateway["ingress"] if "from" in rule for p in rule["ports"]} == {
        metrics_port
    }


def quantity_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity ("1536Mi", "2Gi") in bytes."""
    number, unit = re.fullmatch(r"(\d+)(Ki|Mi|Gi)?", quantity).groups()
    return int(number) * {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}[unit]


def test_the_manifests_valkey_keeps_its_data_across_a_kill_and_requires_the_password(tmp_path):
    docs = render("cpu")
    valkey = container(docs, "kvserve-redis", "valkey")
    maxmemory = keeps_data_across_a_kill([str(word) for word in valkey["args"]], tmp_path)
    # its container is not killed before Redis refuses writes; the stored responses, which tenants grow, stay well
    # below it (the rest: keys, indexes, limits)
    assert maxmemory < quantity_bytes(valkey["resources"]["limits"]["memory"])
    gateway = parse_kvserve(argv(container(docs, "kvserve-gateway", "gateway")), "gateway")
    assert store_limits(gateway).max_total_bytes <= maxmemory // 2


def test_redis_is_durable_and_password_protected_from_the_secret(overlay):
    _, docs = overlay
    statefulset = one(docs, "StatefulSet", "kvserve-redis")
    valkey = container(docs, "kvserve-redis", "valkey")
    words = [str(w) for w in valkey["args"]]
    assert flag(words, "--appendonly") == "yes"
    password = re.fullmatch(r"\$\((\w+)\)", flag(words, "--requirepass"))
    (var,) = [v for v in valkey["env"] if v["name"] == password.group(1)]
    assert var["valueFrom"]["secretKeyRef"] == {"name": "kvserve-redis", "key": "password"}
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    assert {"name": claim["metadata"]["name"], "mountPath": flag(words, "--dir")} in valkey["volumeMounts"]
    # every kvserve container reaches it with the password from the same Secret, in its URL
    for workload in ("kvserve-gateway", "kvserve-executor"):
        for each in pod_specs(docs)[workload]["containers"]:
            url = environment(each)["KVSERVE_REDIS_URL"]
            assert url == f"redis://:{SAMPLE_SECRET}@kvserve-redis:6379/0", workload


def test_the_model_is_pulled_into_one_shared_volume_that_every_pod_waits_for(overlay):
    _, docs = overlay
    claim = one(docs, "PersistentVolumeClaim", "kvserve-models")
    assert "ReadWriteMany" in claim["spec"]["accessModes"]
    for workload in ("kvserve-gateway", "kvserve-executor"):
        spec = pod_specs(docs)[workload]
        volume = next(v for v in spec["volumes"] if v.get("persistentVolumeClaim"))
        assert volume["persistentVolumeClaim"]["claimName"] == "kvserve-models"
        (init,) = spec["initContainers"]
        words = argv(init)
        assert words[1:3] in (["model", "pull"], ["model", "wait"])
        for each in containers(spec):
            mount = next(m for m in each["volumeMounts"] if m["name"] == volume["name"])
            assert environment(each)["KVSERVE_CACHE_DIR"] == mount["mountPath"]
            # only the pull writes: serving containers mount it read-only
            pulls = each is init and words[1:3] == ["model", "pull"]
            assert mount.get("readOnly", False) is not pulls, f"{workload}/{each['name']}"


def test_executors_and_gateways_hold_their_sides_curve_keys_from_secrets(overlay, tmp_path):
    """Each side mounts a Secret at its KVSERVE_CURVE_KEYS; files named as `kvserve curve-keys` writes them
    and, split as docs/deployment.md's secrets split them, load on each side."""
    from kvserve.curve_keys_cli import write_keys
    from shared.curve_keys import load_executor_keys, load_gateway_keys

    _, docs = overlay
    wanted = {
        "executor": ("executor.key_secret", "gateway.key"),
        "gateway": ("gateway.key_secret", "executor.key"),
    }
    write_keys(tmp_path / "all")
    for side, files in wanted.items():
        spec = pod_specs(docs)[f"kvserve-{side}"]
        main_container = container(docs, f"kvserve-{side}", side)
        directory = environment(main_container)["KVSERVE_CURVE_KEYS"]
        mount = next(m for m in main_container["volumeMounts"] if m["mountPath"] == directory)
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        assert volume["secret"]["secretName"] == f"kvserve-curve-{side}" and mount["readOnly"] is True
        assert volume["secret"]["defaultMode"] == 0o400
        only_these = tmp_path / side  # what `kubectl create secret --from-file` of the two files mounts
        only_these.mkdir()
        for name in files:
            (only_these / name).write_bytes((tmp_path / "all" / name).read_bytes())
        (load_executor_keys if side == "executor" else load_gateway_keys)(only_these)


def test_gpu_overlay_gives_each_executor_one_gpu_and_cuda(overlay):
    name, docs = overlay
    executor = container(docs, "kvserve-executor", "executor")
    words = argv(executor)
    if name == "gpu":
        assert flag(words, "--device") == "cuda"
        assert executor["resources"]["limits"]["nvidia.com/gpu"] == 1
    else:
        assert flag(words, "--device") == "cpu"
        assert "nvidia.com/gpu" not in str(executor["resources"])


def test_traces_and_metrics_are_configurable(overlay):
    _, docs = overlay
    configmap = next(
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("kvserve-telemetry")
    )
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in configmap["data"]
    for workload in ("kvserve-gateway", "kvserve-executor"):
        for each in pod_specs(docs)[workload]["containers"]:
            assert {"configMapRef": {"name": configmap["metadata"]["name"]}} in each["envFrom"]
    template = one(docs, "Deployment", "kvserve-gateway")["spec"]["template"]
    annotations = template["metadata"]["annotations"]
    gateway = argv(container(docs, "kvserve-gateway", "gateway"))
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == flag(gateway, "--metrics-port")


def test_the_grafana_dashboard_ships_as_a_configmap_for_grafanas_sidecar(overlay):
    _, docs = overlay
    (configmap,) = [
        d
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"].get("labels", {}).get("grafana_dashboard") == "1"
    ]
    dashboard = REPO / "deploy" / "grafana" / "dashboards" / "kvserve.json"
    assert configmap["data"] == {dashboard.name: dashboard.read_text()}  # the file compose's Grafana loads
    # no hash suffix: a new version replaces the old ConfigMap instead of the sidecar loading both
    assert configmap["metadata"]["name"] == "kvserve-grafana-dashboard"
    # the ServiceMonitor is a component to add: a cluster without the Prometheus Operator's CRD refuses it
    assert not [d for d in docs if d["kind"] == "ServiceMonitor"]


def test_the_prometheus_operator_component_monitors_the_gateways_metrics_port(tmp_path):
    """An overlay of the user's own adding the component, as its kustomization.yaml tells."""
    component = KUBERNETES / "components" / "prometheus-operator"
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                # kustomize takes no absolute paths here
                "resources": [os.path.relpath(KUBERNETES / "overlays" / "gpu", tmp_path)],
                "components": [os.path.relpath(component, tmp_path)],
            }
        )
    )
    docs = render_directory(tmp_path)
    monitor = one(docs, "ServiceMonitor", "kvserve-gateway")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    (service,) = [
        d
        for d in docs
        if d["kind"] == "Service" and selects(monitor["spec"]["selector"], d["metadata"]["labels"])
    ]
    assert service["metadata"]["name"] == "kvserve-gateway"
    (endpoint,) = monitor["spec"]["endpoints"]
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    gateway = container(docs, "kvserve-gateway", "gateway")
    (served,) = [p for p in gateway["ports"] if p["name"] == port["targetPort"]]
    assert served["containerPort"] == int(flag(argv(gateway), "--metrics-port"))
    annotations = one(docs, "Deployment", "kvserve-gateway")["spec"]["template"]["metadata"]["annotations"]
    assert endpoint["path"] == annotations["prometheus.io/path"]  # the one test_gateway_probes_... scrapes


# -- no secret in any manifest or in compose.yaml ---------------------------------------------------------------

# a URL with a password that is not a $(VAR) / ${VAR} reference
LITERAL_PASSWORD_URL = re.compile(r"\w+://[^/\s@]*:(?!\$\(\w+\)@|\$\{[^}]+\}@)[^/\s@]+@")


def shipped_files() -> list[Path]:
    return [REPO / "compose.yaml", *sorted(KUBERNETES.rglob("*.yaml"))]


def test_no_secret_value_is_inline_in_a_manifest_or_compose():
    for path in shipped_files():
        text = path.read_text()
        assert not LITERAL_PASSWORD_URL.search(text), f"{path}: a password written into a URL"
        for doc in filter(None, yaml.safe_load_all(text)):
            if doc.get("kind") == "Secret":
                pytest.fail(f"{path}: a Secret with its values in the manifest (create it with kubectl)")
            for generator in doc.get("secretGenerator", []):
                assert not generator.get("literals"), f"{path}: secretGenerator literals"
        for match in re.finditer(r"--requirepass\s*\n?\s*-?\s*(\S+)", text):
            assert match.group(1).startswith(("$(", "${")), f"{path}: --requirepass {match.group(1)}"


def test_the_secret_check_catches_a_literal_password():
    assert LITERAL_PASSWORD_URL.search("KVSERVE_REDIS_URL: redis://:hunter2@redis:6379/0")
    assert LITERAL_PASSWORD_URL.search("value: rediss://user:hunter2@redis:6379/0")
    assert not LITERAL_PASSWORD_URL.search("value: redis://:$(KVSERVE_REDIS_PASSWORD)@kvserve-redis:6379/0")
    assert not LITERAL_PASSWORD_URL.search("redis://:${KVSERVE_REDIS_PASSWORD:?set it in .env}@redis:6379/0")


# -- the probes reach what a real gateway serves ----------------------------------------------------------------


def test_gateway_probes_and_scrape_reach_a_real_gateway_run_as_the_manifest_runs_it(default_model, tmp_path):
    docs = render("cpu")
    gateway = container(docs, "kvserve-gateway", "gateway")
    words = argv(gateway)
    ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    # the manifest's own arguments, on free loopback ports (no cluster here): the same flags, the same routes
    local = {int(flag(words, "--port")): free_port(), int(flag(words, "--metrics-port")): free_port()}
    args = list(words[2:])
    for option in ("--port", "--metrics-port"):
        args[args.index(option) + 1] = str(local[int(flag(words, option))])
    args[args.index("--host") + 1] = "127.0.0.1"
    server = start_redis_server(password=SAMPLE_SECRET)
    try:
        assert (
            main(["keys", "create", "--tenant", "probe", "--redis-url", server.url]) == 0
        )  # --require-api-key
        process = GatewayProcess(default_model, server.url, tmp_path / "gateway.log", *args)
        try:

            def answers(path: str, port: int) -> int | None:
                try:
                    return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5).status_code
                except httpx.HTTPError:
                    return None

            public = local[int(flag(words, "--port"))]
            assert eventually(lambda: answers("/health/live", public) == 200, 60), (
                process.log_path.read_text()
            )
            for kind in ("readinessProbe", "livenessProbe"):
                probe = gateway[kind]["httpGet"]
                status = answers(probe["path"], local[ports[probe["port"]]])
                # readiness: 503 while no executor is registered (none here); the route exists and answers
                assert status == (200 if kind == "livenessProbe" else 503), (kind, status)
            annotations = one(docs, "Deployment", "kvserve-gateway")["spec"]["template"]["metadata"][
                "annotations"
            ]
            scrape = answers(annotations["prometheus.io/path"], local[int(annotations["prometheus.io/port"])])
            assert scrape == 200
        finally:
            process.stop()
    finally:
        server.stop()
