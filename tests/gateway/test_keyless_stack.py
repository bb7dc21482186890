"""Requests without a valid key, over real processes (the shared keyed_stack, and a gateway of this module's own in
it with a short body deadline): refused from
the headers alone, before a byte of the body is read, so a flood of them costs the gateway next to nothing; large
prompts are worked through off the event loop; slow bodies get 408; and once a deployment has had keys, neither
revoking the last one nor a Redis flushed empty opens it again. A gateway open to other machines is an operator's
explicit choice."""

from __future__ import annotations

import json
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis

from gateway.openai.body import MAX_BODY_BYTES
from gateway.tenants.api_keys import KeyStore
from kvserve.cli import build_parser
from tests.gateway.answers import openai_error
from tests.gateway.http_wire import pipelined, request
from tests.processes import GatewayProcess, free_port, run_kvserve
from tests.stacks import serving_stack

BODY_TIMEOUT_S = 2.0
FLOOD = 20
# what /health/live may take while the gateway is flooded; parsing and tokenizing one of the flood's bodies on
# the event loop took 11 s on a 2-core machine
LIVE_BOUND_S = 2.0


def _distinct_words(size: int) -> str:
    """Text of about `size` bytes in words the tokenizer has never cached: about 3 us a byte to tokenize."""
    return " ".join(f"w{i:x}q" for i in range(size // 8))


# valid JSON just under the body limit: refused (400, temperature) once parsed, and seconds of work if served
REFUSED_IF_PARSED = json.dumps(
    {"model": "tiny", "temperature": 5, "prompt": _distinct_words(4_000_000)}
).encode()
EXPENSIVE_IF_PARSED = json.dumps(
    {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": _distinct_words(4_000_000)}]}
).encode()
assert len(REFUSED_IF_PARSED) < MAX_BODY_BYTES and len(EXPENSIVE_IF_PARSED) < MAX_BODY_BYTES
UNKNOWN_KEY = "kvs_0123456789abcdef_" + "A" * 43


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _post(base: str, body: bytes, headers: dict[str, str], path: str = "/v1/completions") -> httpx.Response:
    headers = {"content-type": "application/json", **headers}
    return httpx.post(f"{base}{path}", content=body, headers=headers, timeout=120)


@pytest.fixture(scope="module")
def keyed(keyed_stack):
    """(gateway, its Redis url, a valid key): a deployment with keys, a gateway on loopback without
    --require-api-key, and a short body deadline."""
    key, _ = keyed_stack.key_store().create("victim")
    gateway = keyed_stack.add_gateway("--body-timeout", str(BODY_TIMEOUT_S), name="keyless-gateway")
    yield gateway, keyed_stack.url, key
    keyed_stack.remove(gateway)


def test_without_a_valid_key_the_body_is_never_read(keyed):
    gateway, url, key = keyed
    revoked, record = KeyStore(redis.Redis.from_url(url)).create("gone")
    KeyStore(redis.Redis.from_url(url)).revoke(record.key_id)
    for headers in (
        {},
        _bearer("sk-anything"),
        _bearer(UNKNOWN_KEY),
        _bearer(revoked),
        {"authorization": key},
    ):
        assert openai_error(_post(gateway.base, REFUSED_IF_PARSED, headers), 401)["code"] == "invalid_api_key"
    # a body over the limit, too: who calls comes before what the body did wrong
    too_large = REFUSED_IF_PARSED + b" " * (MAX_BODY_BYTES - len(REFUSED_IF_PARSED) + 1)
    openai_error(_post(gateway.base, too_large, {}), 401)
    # with the key, the same bodies are read and refused for what they are
    assert openai_error(_post(gateway.base, REFUSED_IF_PARSED, _bearer(key)), 400)["param"] == "temperature"
    assert openai_error(_post(gateway.base, too_large, _bearer(key)), 413)["code"] == "request_too_large"


def test_a_401_keeps_the_connection_for_a_small_body_and_closes_it_for_a_large_one(keyed):
    gateway, _, key = keyed
    small = json.dumps({"model": "tiny", "prompt": "x" * 1000}).encode()
    answers = pipelined(
        gateway.port,
        [
            request("POST", "/v1/completions", small),
            request("GET", "/v1/models", close=True, headers=_bearer(key)),
        ],
    )
    assert [status for status, _ in answers] == [401, 200]
    assert [m["id"] for m in json.loads(answers[1][1])["data"]] == ["tiny"]
    # a large body: the 401 comes, and closes the connection, while most of it is still unsent
    whole = request("POST", "/v1/completions", REFUSED_IF_PARSED)
    head_end = whole.index(b"\r\n\r\n") + 4
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=60) as sock:
        sock.sendall(whole[: head_end + 1024])
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head = data.partition(b"\r\n\r\n")[0].decode("latin-1").lower()
    assert head.startswith("http/1.1 401") and "connection: close" in head


MIB = 1024 * 1024


@pytest.mark.parametrize("size", [MIB, MAX_BODY_BYTES])
def test_a_keyless_client_that_sends_its_whole_large_body_reads_the_401(keyed, size):
    """The server half-closes after the 401 and throws away the rest of the body (a lingering close): a close with
    the body unread would answer the client's next bytes with a reset, which discards the 401 before it is read."""
    gateway, _, _ = keyed
    body = json.dumps({"model": "tiny", "prompt": "x" * (size - 40)}).encode()
    for _ in range(3):  # a reset is a race the client may win now and then: every try must read the 401
        assert openai_error(_post(gateway.base, body, {}), 401)["code"] == "invalid_api_key"
    # by hand: the whole body written, then everything the server sent, up to its FIN
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=60) as sock:
        sock.sendall(request("POST", "/v1/completions", body))
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, answer = data.partition(b"\r\n\r\n")
    assert head.lower().startswith(b"http/1.1 401") and b"connection: close" in head.lower()
    assert json.loads(answer)["error"]["code"] == "invalid_api_key"


def test_a_keyless_client_that_never_stops_sending_is_cut_off(keyed):
    """What the server reads after a 401 is bounded: a chunked body without end is read only so far."""
    gateway, _, _ = keyed
    head = "POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ntransfer-encoding: chunked\r\n\r\n"
    chunk = b"%x\r\n%s\r\n" % (MIB, b"x" * MIB)
    sent = 0
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=30) as sock:
        sock.sendall(head.encode())
        with pytest.raises(OSError):  # reset, or a broken pipe: the server has stopped reading
            while sent < 20 * MAX_BODY_BYTES:
                sock.sendall(chunk)
                sent += len(chunk)
    assert sent < 20 * MAX_BODY_BYTES  # the sender's and receiver's socket buffers hold a few MiB at most


def test_a_keyless_flood_never_delays_liveness_or_a_keyed_request(keyed):
    gateway, _, key = keyed
    live_waits = []
    with ThreadPoolExecutor(FLOOD + 1) as pool:
        flood = [
            pool.submit(_post, gateway.base, EXPENSIVE_IF_PARSED, {}, "/v1/chat/completions")
            for _ in range(FLOOD)
        ]
        served = pool.submit(
            _post, gateway.base, b'{"model": "tiny", "prompt": "Hi", "max_tokens": 2}', _bearer(key)
        )
        while True:
            started = time.monotonic()
            assert httpx.get(f"{gateway.base}/health/live", timeout=60).status_code == 200
            live_waits.append(time.monotonic() - started)
            if all(f.done() for f in flood):
                break
            time.sleep(0.05)
        assert [f.result().status_code for f in flood] == [401] * FLOOD
        assert served.result().status_code == 200, served.result().text
    assert max(live_waits) < LIVE_BOUND_S, live_waits


def test_a_large_prompt_is_tokenized_off_the_event_loop(keyed):
    gateway, _, key = keyed
    # seconds of tokenizing; it is far over the tiny model's context
    body = json.dumps({"model": "tiny", "max_tokens": 1, "prompt": _distinct_words(2_000_000)}).encode()
    live_waits = []
    with ThreadPoolExecutor(1) as pool:
        large = pool.submit(_post, gateway.base, body, _bearer(key))
        while not large.done():
            started = time.monotonic()
            assert httpx.get(f"{gateway.base}/health/live", timeout=60).status_code == 200
            live_waits.append(time.monotonic() - started)
            time.sleep(0.05)
        large.result()  # answered; how (its prompt is far over the context) is not the point here
    # it took long enough to be probed while it ran, and no probe waited for it
    assert len(live_waits) >= 3 and max(live_waits) < LIVE_BOUND_S, live_waits


def test_a_slow_body_gets_408_at_its_deadline_and_the_connection_closes(keyed):
    gateway, _, key = keyed
    head = request("POST", "/v1/completions", b"x" * 1000, headers=_bearer(key)).removesuffix(b"x" * 1000)
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=30) as sock:
        started = time.monotonic()
        sock.sendall(head + b'{"model": "tiny", ')
        # a byte now and then does not move the deadline: it is wall-clock, not idle time
        while time.monotonic() - started < BODY_TIMEOUT_S - 0.3:
            sock.sendall(b" ")
            time.sleep(0.2)
        data = b""
        while chunk := sock.recv(65536):  # read until the server closes the connection
            data += chunk
        waited = time.monotonic() - started
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), data
    assert b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "request_timeout"
    # an idle timer restarted by the last byte would have fired BODY_TIMEOUT_S after it
    assert BODY_TIMEOUT_S - 0.1 <= waited < 2 * BODY_TIMEOUT_S - 0.3, waited


def test_once_keys_existed_the_gateway_never_runs_open_again(tiny_models, tmp_path):
    """No executor: every answer here comes from the gateway's reading of the caller."""
    with serving_stack(tiny_models["llama"], tmp_path, executors=0) as own:
        gateway = own.gateway
        assert httpx.get(f"{gateway.base}/v1/models").status_code == 200  # open: no key ever existed
        assert httpx.get(f"{gateway.base}/metrics").status_code == 200  # every request is the anonymous one's
        store = own.key_store()
        key, record = store.create("acme-corp")
        assert httpx.get(f"{gateway.base}/v1/models", headers=_bearer(key)).status_code == 200
        _assert_closed(gateway)

        store.revoke(record.key_id)  # the last key
        _assert_closed(gateway)
        restarted = own.add_gateway(name="restarted")
        _assert_closed(restarted)  # a new process too: Redis remembers that keys existed

        redis.Redis.from_url(own.url).flushall()  # Redis restarted empty, or failed over to an empty replica
        for running in own.gateways:
            _assert_closed(running)  # each process remembers, for its life


def _assert_closed(gateway: GatewayProcess) -> None:
    """Requests without a key get 401 and the public port names no tenant."""
    assert "API keys" in openai_error(httpx.get(f"{gateway.base}/v1/models"), 401)["message"]
    openai_error(_post(gateway.base, b'{"model": "tiny", "prompt": "hi"}', {}), 401)
    metrics = httpx.get(f"{gateway.base}/metrics")
    assert "--metrics-port" in openai_error(metrics, 404)["message"] and "acme" not in metrics.text


def test_an_open_gateway_on_a_non_loopback_address_is_an_explicit_choice(tiny_models, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "KVSERVE_REDIS_URL"}
    with serving_stack(tiny_models["llama"], tmp_path, executors=0, gateways=0) as own:
        refused = run_kvserve("gateway", "--host", "0.0.0.0", "--redis-url", own.url, env=env)
        assert refused.returncode == 2, refused.stderr
        (line,) = refused.stderr.strip().splitlines()
        assert "0.0.0.0" in line and "kvserve keys create" in line and "--allow-anonymous" in line
        both = ["--host", "0.0.0.0", "--allow-anonymous", "--require-api-key", "--redis-url", own.url]
        contradiction = run_kvserve("gateway", *both, env=env)
        assert contradiction.returncode == 2 and "contradict" in contradiction.stderr

        gateway = own.add_gateway("--host", "0.0.0.0", "--allow-anonymous", name="anonymous")
        assert httpx.get(f"{gateway.base}/v1/models").status_code == 200  # open, as asked
        assert "WITHOUT API KEYS" in gateway.log_path.read_text()

        own.key_store().create("someone")  # a keyed deployment needs no flag
        keyed = own.add_gateway("--host", "0.0.0.0", name="keyed")
        openai_error(httpx.get(f"{keyed.base}/v1/models"), 401)


def test_a_gateway_on_a_non_loopback_address_does_not_start_while_redis_is_unreachable(tmp_path):
    """It cannot tell whether API keys exist, so it may not serve (open or not) until it can: exit 1, not a start."""
    env = {k: v for k, v in os.environ.items() if k != "KVSERVE_REDIS_URL"}
    unreachable = f"redis://127.0.0.1:{free_port()}/0"
    for flags in ((), ("--allow-anonymous",)):
        refused = run_kvserve("gateway", "--host", "0.0.0.0", "--redis-url", unreachable, *flags, env=env)
        assert refused.returncode == 1, refused.stderr
        line = refused.stderr.strip().splitlines()[-1]
        assert "kvserve gateway: error: --redis-url" in line and "non-loopback --host (0.0.0.0)" in line, line


def test_the_flags_of_up():
    args = build_parser("up").parse_args(["up", "--allow-anonymous", "--body-timeout", "5"])
    assert args.allow_anonymous and args.body_timeout == 5.0  # run_up hands its args to run_gateway
