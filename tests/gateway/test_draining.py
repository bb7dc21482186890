"""`kvserve gateway` drains on SIGTERM: its port stays open, new requests get 503 + Retry-After in OpenAI's
shape while the one in flight finishes, and for a moment after (a client that comes just then is told to go
elsewhere, not refused a connection), then it exits 0."""

from __future__ import annotations

import socket
import time

import httpx

from tests.processes import GatewayProcess, eventually


def listening(gateway: GatewayProcess) -> bool:
    try:
        httpx.get(f"{gateway.base}/health", timeout=5)
        return True
    except httpx.HTTPError:
        return False


def test_sigterm_keeps_answering_503_until_the_request_in_flight_ends(tiny_models, redis_url, tmp_path):
    gateway = GatewayProcess(
        tiny_models["llama"], redis_url, tmp_path / "gateway.log", "--shutdown-grace-period", "30"
    )
    try:
        assert eventually(lambda: listening(gateway), timeout=120), gateway.log_path.read_text()
        # a request in flight that needs no executor: its body is still on its way when SIGTERM comes
        body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}'
        slow = socket.create_connection(("127.0.0.1", gateway.port), timeout=30)
        head = "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        slow.sendall(f"{head}content-length: {len(body)}\r\n\r\n".encode() + body[:10])
        time.sleep(0.5)
        gateway.process.terminate()
        time.sleep(0.5)
        refused = httpx.post(f"{gateway.base}/v1/chat/completions", json={"model": "tiny"}, timeout=10)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "draining"
        assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
        assert 1 <= int(refused.headers["retry-after"]) <= 30
        assert refused.headers["connection"] == "close"
        health = httpx.get(f"{gateway.base}/health", timeout=10)
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        live = httpx.get(f"{gateway.base}/health/live", timeout=10)  # no liveness probe kills the drain
        assert live.status_code == 200 and live.json() == {"status": "alive"}
        assert gateway.process.poll() is None  # waiting for the request in flight
        slow.sendall(body[10:])
        answer = slow.recv(65536).decode()
        assert answer.startswith("HTTP/1.1 "), answer  # answered in full (no executor here: a 503 of its own)
        assert '"code":"draining"' not in answer
        slow.close()
        time.sleep(0.5)  # nothing in flight since: a client arriving now still gets the 503, not a refusal
        late = httpx.post(f"{gateway.base}/v1/completions", json={"model": "tiny"}, timeout=10)
        assert late.status_code == 503 and late.json()["error"]["code"] == "draining"
        assert gateway.process.wait(10) == 0
        log = gateway.log_path.read_text()
        assert "draining (SIGTERM)" in log and "drained: no request in flight" in log
    finally:
        gateway.stop()
