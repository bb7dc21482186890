"""Issue 48's KV tiers as compose.yaml and the Kubernetes overlays deploy them (read, not run: no Docker engine
or cluster here): every executor has its own disk tier on a volume mounted where --kv-offload-dir points, sized
below what that volume may hold, and serves KV pulls on a port other executors can reach."""

from __future__ import annotations

import re

import pytest

from executor.engine_config import KV_OFFLOAD_DEFAULT_BYTES, parse_bytes
from kvserve.cli import build_parser
from tests.test_deployment import VARIANTS, load_compose
from tests.test_kubernetes import OVERLAYS, argv, container, one, parse_kvserve, pod_specs, render, selects

_QUANTITY = re.compile(r"(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?")
_QUANTITY_UNITS = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_QUANTITY_UNITS |= {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def quantity(text: str | int) -> int:
    """A Kubernetes resource quantity in bytes ("20Gi", "512M", 1024)."""
    match = _QUANTITY.fullmatch(str(text))
    assert match, f"cannot read {text!r} as a quantity"
    return int(match.group(1)) * _QUANTITY_UNITS[match.group(2)]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_compose_executor_has_its_own_disk_tier_volume_and_a_transfer_port(variant):
    compose = load_compose(*VARIANTS[variant])
    executors = {name: s for name, s in compose["services"].items() if name.startswith("executor")}
    assert executors
    tier_volumes = []
    for name, service in executors.items():
        args = build_parser("executor").parse_args([str(word) for word in service["command"][1:]])
        assert args.kv_offload_dir and parse_bytes(args.kv_offload_disk) > 0, name
        mounted = {v.split(":")[1]: v.split(":")[0] for v in service["volumes"]}
        volume = mounted.get(args.kv_offload_dir)
        assert volume in compose["volumes"], f"{name}: no named volume at {args.kv_offload_dir}"
        tier_volumes.append(volume)
        assert not any(v.endswith(":ro") for v in service["volumes"] if v.startswith(f"{volume}:")), name
        # the gateways' port and the pulls' port differ; other executors reach the latter on the network
        bind_port = int(args.bind.rsplit(":", 1)[1])
        assert 0 < args.kv_transfer_port != bind_port, name
        assert str(args.kv_transfer_port) in service["expose"], name
        assert "ports" not in service, f"{name}: KV and requests must stay off the host's ports"
    assert len(set(tier_volumes)) == len(tier_volumes), "two executors share one disk tier"


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> tuple[str, list[dict]]:
    return request.param, render(request.param)


def executor_args(docs: list[dict]):
    return parse_kvserve(argv(container(docs, "kvserve-executor", "executor")), "kvserve-executor")


def test_kubernetes_executors_keep_their_disk_tier_on_a_size_limited_empty_dir(overlay):
    _, docs = overlay
    spec = pod_specs(docs)["kvserve-executor"]
    executor = container(docs, "kvserve-executor", "executor")
    args = executor_args(docs)
    (mount,) = [m for m in executor["volumeMounts"] if m["mountPath"] == args.kv_offload_dir]
    assert not mount.get("readOnly", False)
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    limit = quantity(volume["emptyDir"]["sizeLimit"])
    # the kubelet evicts a pod whose emptyDir outgrows its limit: the tier stays below it, with room to spare
    assert parse_bytes(args.kv_offload_disk) <= 0.9 * limit
    # scheduled only where the node has that much local storage
    assert quantity(executor["resources"]["requests"]["ephemeral-storage"]) >= limit


def test_kubernetes_executors_host_tier_fits_in_their_memory_limit(overlay):
    name, docs = overlay
    executor = container(docs, "kvserve-executor", "executor")
    args = executor_args(docs)
    host_tier = (
        parse_bytes(args.kv_offload_memory)
        if args.kv_offload_memory is not None
        else KV_OFFLOAD_DEFAULT_BYTES[args.device]
    )
    # the tier's memory is the process's own (pinned on CUDA): over the limit, the kernel kills the executor
    room = quantity(executor["resources"]["limits"]["memory"]) - host_tier
    assert room >= 8 * 2**30, f"{name}: {room / 2**30:.0f} GiB left beside the host tier"


def test_kubernetes_executors_serve_kv_pulls_to_each_other_only(overlay):
    _, docs = overlay
    executor = container(docs, "kvserve-executor", "executor")
    port = executor_args(docs).kv_transfer_port
    assert {"name": "kv-transfer", "containerPort": port} in executor["ports"]
    policy = one(docs, "NetworkPolicy", "kvserve-executor")["spec"]
    labels = one(docs, "StatefulSet", "kvserve-executor")["spec"]["template"]["metadata"]["labels"]
    workloads = {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
    }
    admitted = {
        name
        for rule in policy["ingress"]
        if port in {p["port"] for p in rule["ports"]}
        for peer in rule["from"]
        for name, pod in workloads.items()
        if selects(peer["podSelector"], pod)
    }
    assert selects(policy["podSelector"], labels) and admitted == {"kvserve-executor"}
