"""CURVE between gateway and executor, as real processes: a keyed executor serves a gateway holding the right
keys and nobody else; a gateway with the wrong keys, or none, never counts it live and says why."""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import zmq
import zmq.auth

from kvserve.curve_keys_cli import write_keys
from tests.processes import ExecutorProcess, GatewayProcess, eventually, free_port, raw_generate, run_kvserve
from tests.stacks import serving_stack

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
NOTHING_WITHIN_S = 3.0  # a served request answers in well under a second here


@pytest.fixture(scope="module")
def keyed(tiny_models, tmp_path_factory):
    """A stack of one executor started with --curve-keys and no gateway: (stack, executor, its keys directory).
    Each test starts its gateway in it."""
    logs = tmp_path_factory.mktemp("curve")
    keys = logs / "keys"
    write_keys(keys)
    curve = ("--curve-keys", str(keys))
    with serving_stack(tiny_models["llama"], logs, executor_flags=curve, gateways=0) as stack:
        yield stack, stack.executor, keys


def _refusal(gateway: GatewayProcess) -> dict | None:
    """/health's answer while it names a refused executor, else None."""
    try:
        response = httpx.get(f"{gateway.base}/health", timeout=10)
    except httpx.HTTPError:
        return None
    body = response.json()
    return body if response.status_code == 503 and body.get("refused") else None


def test_gateway_with_the_keys_serves_a_chat_streamed_and_whole(keyed):
    stack, executor, keys = keyed
    gateway = stack.add_gateway("--curve-keys", str(keys), name="gateway-ok")
    try:
        assert httpx.get(f"{gateway.base}/health").json()["executors"] == [executor.id]
        whole = httpx.post(f"{gateway.base}/v1/chat/completions", json=CHAT, timeout=60)
        assert whole.status_code == 200, whole.text
        assert whole.json()["usage"]["completion_tokens"] == 4
        with httpx.stream(
            "POST", f"{gateway.base}/v1/chat/completions", json={**CHAT, "stream": True}, timeout=60
        ) as streamed:
            lines = [line for line in streamed.iter_lines() if line.startswith("data: ")]
        assert streamed.status_code == 200 and lines[-1] == "data: [DONE]"
        assert len(lines) >= 3  # role, tokens, [DONE]
    finally:
        stack.remove(gateway)


def test_raw_dealer_without_an_authorized_key_gets_nothing(keyed):
    _, executor, keys = keyed
    public, secret = zmq.curve_keypair()
    server_public, _ = zmq.auth.load_certificate(keys / "executor.key")
    with ThreadPoolExecutor(2) as pool:  # both wait out the silence at once
        plain = pool.submit(raw_generate, executor.address, NOTHING_WITHIN_S)
        unknown = pool.submit(
            raw_generate, executor.address, NOTHING_WITHIN_S, (public, secret, server_public)
        )
        assert plain.result() is None and unknown.result() is None
    # the executor says what it refused
    assert eventually(lambda: public.decode() in executor.log_path.read_text(errors="replace"), timeout=5)
    # and the authorized key does get an answer over the same path: the silence above is the keys' doing
    gateway_public, gateway_secret = zmq.auth.load_certificate(keys / "gateway.key_secret")
    assert raw_generate(executor.address, 30, (gateway_public, gateway_secret, server_public)) is not None


@pytest.mark.parametrize(
    "case, cause",
    [
        ("no keys", "the executor requires CURVE keys and this gateway has none"),
        ("another executor key", "its public key is not the executor.key this gateway holds"),
        ("unauthorized gateway key", "refused this gateway's CURVE key"),
    ],
)
def test_gateway_with_wrong_keys_never_counts_the_executor_live_and_says_why(keyed, tmp_path, case, cause):
    stack, executor, keys = keyed
    other = tmp_path / "other"
    write_keys(other)
    extra: list[str] = []
    if case == "another executor key":  # the right gateway pair, another run's executor.key
        mixed = tmp_path / "mixed"
        mixed.mkdir()
        shutil.copy(keys / "gateway.key_secret", mixed)
        shutil.copy(other / "executor.key", mixed)
        extra = ["--curve-keys", str(mixed)]
    elif case == "unauthorized gateway key":  # the right executor.key, a gateway pair it never heard of
        shutil.copy(keys / "executor.key", other / "executor.key")
        extra = ["--curve-keys", str(other)]
    gateway = stack.start_gateway(*extra, name=f"gateway-{case.replace(' ', '-')}")
    try:
        _assert_refused(gateway, executor, cause)
    finally:
        stack.remove(gateway)


def _assert_refused(gateway: GatewayProcess, executor: ExecutorProcess, cause: str) -> None:
    """The gateway's first request (before any /health) gets a 503 soon, not a hang; then /health names the
    executor as refused, with the cause, and keeps doing so; the log says it too."""
    assert eventually(lambda: _answers(f"{gateway.base}/v1/models"), timeout=60), gateway.log_path.read_text()
    chat = httpx.post(f"{gateway.base}/v1/chat/completions", json=CHAT, timeout=30)
    assert chat.status_code == 503 and chat.json()["error"]["type"] == "server_error", chat.text
    # which event a mismatch gives the first time is a race; retries (every 100 ms) tell the rest
    assert eventually(lambda: cause in _refusal(gateway)["refused"][executor.id], timeout=10), _refusal(
        gateway
    )
    assert _refusal(gateway)["executors"] == []
    assert cause in gateway.log_path.read_text(errors="replace")
    time.sleep(1)
    assert _refusal(gateway) is not None and not gateway.healthy()  # it stays unavailable, not only at first


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_an_executor_without_keys_refuses_an_address_other_machines_reach_unless_told(tiny_models, tmp_path):
    """Fail closed, as a gateway without API keys on a non-loopback --host does: the refusal names the flag."""
    env = {k: v for k, v in os.environ.items() if k not in ("KVSERVE_CURVE_KEYS", "KVSERVE_REDIS_URL")}
    base = ["executor", "--executor-id", "open", "--model", tiny_models["llama"], "--device", "cpu"]
    base += ["--redis-url", f"redis://127.0.0.1:{free_port()}/0"]  # refused before Redis is asked
    local = ["--bind", f"tcp://127.0.0.1:{free_port()}"]
    for flags, listener in (
        (["--bind", f"tcp://0.0.0.0:{free_port()}"], "--bind tcp://0.0.0.0:"),
        (
            [*local, "--kv-transfer-port", str(free_port()), "--kv-transfer-host", "0.0.0.0"],
            "--kv-transfer-host",
        ),
    ):
        refused = run_kvserve(*base, *flags, env=env)
        assert refused.returncode == 2, refused.stderr
        (line,) = refused.stderr.strip().splitlines()
        assert listener in line and "--curve-keys" in line and "--allow-insecure-bind" in line, line


@pytest.mark.slow
def test_plain_executor_warns_on_an_open_address_it_was_allowed_and_a_keyed_gateway_says_it_has_no_keys(
    tiny_models, tmp_path
):
    keys = tmp_path / "keys"
    write_keys(keys)
    port = free_port()
    # the last --bind wins: every interface, as a container would, open on purpose
    everywhere = ("--bind", f"tcp://0.0.0.0:{port}", "--advertise-address", f"tcp://127.0.0.1:{port}")
    everywhere += ("--allow-insecure-bind",)
    with serving_stack(tiny_models["llama"], tmp_path, executors=[everywhere], gateways=0) as stack:
        gateway = stack.start_gateway("--curve-keys", str(keys))
        log = stack.executor.log_path.read_text()
        assert "without --curve-keys: anyone who reaches this port can run requests" in log
        assert "no CURVE keys: open to any peer" in log
        _assert_refused(gateway, stack.executor, "the executor has no CURVE keys and this gateway has")
