"""The gateway needs only a tokenizer: its process never loads torch, and gateway/ and shared/ never import
transformers (which imports torch whenever torch is installed)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import httpx

from tests.processes import REPO, GatewayProcess

post = functools.partial(httpx.post, timeout=60)

TORCH_LIBRARIES = ("libtorch", "torch/_C")
GATEWAY_RSS_LIMIT_MIB = 200


def torch_mappings(pid: int) -> list[str]:
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return [line for line in maps if any(name in line for name in TORCH_LIBRARIES)]


def resident_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


def test_gateway_serves_a_chat_without_loading_torch(open_stack):
    gateway, executor = open_stack.gateways[-1], open_stack.executor
    chat = [{"role": "user", "content": "Hi 😀"}]
    body = {"model": "tiny", "messages": chat, "max_tokens": 4, "ignore_eos": True}
    response = post(f"{gateway.base}/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    pid = gateway.process.pid
    assert torch_mappings(pid) == [], f"torch loaded in the gateway (RSS {resident_mib(pid):.0f} MiB)"
    assert resident_mib(pid) < GATEWAY_RSS_LIMIT_MIB  # 82 MiB measured; with transformers and torch, 367
    assert torch_mappings(executor.process.pid)  # the check sees torch where it is loaded


def test_bad_model_directory_is_refused_at_start_naming_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    gateway = GatewayProcess(str(tmp_path), "redis://127.0.0.1:1/0", tmp_path / "gateway.log")
    try:
        assert gateway.process.wait(30) == 2
    finally:
        gateway.stop()
    assert f"--model: {tmp_path / 'tokenizer.json'} is missing" in gateway.log_path.read_text()


def imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
    return modules


def test_gateway_and_shared_never_import_torch_or_transformers():
    wrong = {
        f"{path.relative_to(REPO)} imports {module}"
        for package in ("gateway", "shared")
        for path in sorted((REPO / package).rglob("*.py"))
        for module in imported_modules(path)
        if module.split(".")[0] in ("torch", "transformers")
    }
    assert not wrong, sorted(wrong)
