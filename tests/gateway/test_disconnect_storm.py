"""A disconnect storm through a real stack (Redis, two executors with room for three requests each, a gateway):
forty clients over raw sockets leave at seeded random points — streams before their first token and
mid-stream, non-streaming requests while they wait, bodies cut short, requests held in the gateway's backlog —
some closing gracefully, some with a reset. Afterwards nothing is left behind on any executor, the gateway
counted every one of them once, as a 499 unless its whole answer had been sent before it left (a fast machine
finishes a few), and answered none with a 5xx, and both executors still serve."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import socket
import struct
import time

import httpx
import pytest

from shared import redis_keys as keys
from tests.gateway.answers import metric_samples
from tests.gateway.http_wire import request
from tests.processes import ExecutorProcess, GatewayProcess, eventually
from tests.stacks import serving_stack

CLIENTS = 40
SEED = 13
LONG = 900  # output tokens (the tiny model holds 1,024 positions): few answers end before their client leaves
# at most this many clients may have had their whole answer before leaving: the rest must have left mid-answer
FINISHED_AT_MOST = CLIENTS // 8
KINDS = ("stream_before_first_token", "stream_mid", "whole_waiting", "mid_body")
DRAIN_S = 15  # every executor holds nothing this long after the last client left


@pytest.fixture(scope="module")
def stack(tiny_models, tmp_path_factory):
    bounds = ("--max-num-seqs", "2", "--max-waiting-seqs", "1")  # six slots: most of the storm is held
    with serving_stack(
        tiny_models["llama"],
        tmp_path_factory.mktemp("storm-logs"),
        executors=2,
        executor_flags=bounds,
        gateway_flags=("--queue-timeout", "60"),
        env={"KVSERVE_CPU_KERNELS": "0"},
    ) as stack:
        yield stack.gateway, stack.executors


def _body(i: int, stream: bool) -> bytes:
    body = {"model": "tiny", "prompt": f"storm {i} " * (1 + i % 7), "max_tokens": LONG, "ignore_eos": True}
    return json.dumps({**body, "stream": stream}).encode()


async def _leave(writer: asyncio.StreamWriter, reset: bool) -> None:
    """Close the connection: a FIN, or with `reset` an RST, as a killed client's kernel sends."""
    if reset:
        writer.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
        )
    writer.close()
    with contextlib.suppress(OSError):  # the reset's own echo
        await writer.wait_closed()


async def _client(port: int, i: int, kind: str, rng: random.Random) -> bytes:
    """One client that leaves at its own point; returns what it had received by then."""
    await asyncio.sleep(rng.uniform(0, 0.5))  # arrivals spread a little: some find room, most are held
    reset = rng.random() < 0.5
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    received = b""
    if kind == "mid_body":
        whole = request("POST", "/v1/completions", _body(i, False))
        writer.write(whole[: rng.randint(len(whole) - len(_body(i, False)) + 1, len(whole) - 1)])
        await writer.drain()
        await asyncio.sleep(rng.uniform(0, 0.3))
    else:
        writer.write(request("POST", "/v1/completions", _body(i, kind != "whole_waiting")))
        await writer.drain()
        if kind == "stream_mid":  # after a few events: mid-stream, unless it was held all along
            events, deadline = rng.randint(1, 5), time.monotonic() + rng.uniform(0.5, 3)
            while received.count(b"data: ") < events and time.monotonic() < deadline:
                try:
                    received += await asyncio.wait_for(reader.read(65536), 0.1)
                except TimeoutError:
                    continue
        else:  # before the first token or while the answer is made (or while held in the backlog)
            wait = rng.uniform(0, 0.05) if kind == "stream_before_first_token" else rng.uniform(0.05, 2)
            await asyncio.sleep(wait)
        received += await _arrived(reader)
    await _leave(writer, reset)
    return received


async def _arrived(reader: asyncio.StreamReader) -> bytes:
    """What has arrived unread: an answer sent whole before its client left is rightly counted as a 200."""
    data = b""
    with contextlib.suppress(TimeoutError):
        while chunk := await asyncio.wait_for(reader.read(65536), 0.01):
            data += chunk
    return data


def _whole_answer(received: bytes) -> bool:
    """Whether a 200's whole answer had arrived: a stream's [DONE], or as many body bytes as its length."""
    head, _, body = received.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        return False
    if b"text/event-stream" in head:
        return b"data: [DONE]" in body
    length = re.search(rb"(?i)content-length: (\d+)", head)
    return length is not None and len(body) >= int(length.group(1))


async def _storm(port: int) -> list[tuple[str, bytes]]:
    rng = random.Random(SEED)
    kinds = [KINDS[i % len(KINDS)] for i in range(CLIENTS)]
    rng.shuffle(kinds)
    # each client draws from a generator of its own: the leave points do not depend on scheduling
    clients = [_client(port, i, kind, random.Random(rng.random())) for i, kind in enumerate(kinds)]
    return list(zip(kinds, await asyncio.gather(*clients), strict=True))


def _requests_by_status(gateway: GatewayProcess) -> dict[str, float]:
    counts: dict[str, float] = {}
    for (name, labels), value in metric_samples(f"{gateway.base}/metrics").items():
        if name == "kvserve_requests_total":
            status = dict(labels)["status"]
            counts[status] = counts.get(status, 0) + value
    return counts


def _holds_nothing(executor: ExecutorProcess) -> bool:
    """The executor's own published truth: no KV block in use, nothing running or waiting."""
    stats = executor.redis.hgetall(keys.stats_key(executor.id))
    load = executor.redis.hgetall(keys.load_key(executor.id))
    published = [stats.get("kv_blocks_used"), stats.get("running"), stats.get("waiting")]
    published += [load.get("running"), load.get("waiting")]
    return all(value is not None and float(value) == 0 for value in published)


def _status(received: bytes) -> int | None:
    return int(received.split(b" ", 2)[1]) if received.startswith(b"HTTP/1.1 ") else None


def test_a_disconnect_storm_leaves_nothing_behind_and_every_executor_serves(stack):
    gateway, executors = stack
    before = _requests_by_status(gateway)
    logged = gateway.log_path.stat().st_size
    started = time.monotonic()
    results = asyncio.run(_storm(gateway.port))
    stormed = time.monotonic() - started

    # no 5xx to anyone who got as far as a status line
    statuses = [_status(received) for _, received in results]
    assert not [s for s in statuses if s is not None and s >= 500], statuses
    streamed = [received.count(b"data: {") for kind, received in results if kind == "stream_mid"]
    assert any(streamed), "no stream was left mid-stream: the storm did not test that"

    # every executor lets go of everything the storm started
    assert eventually(lambda: all(map(_holds_nothing, executors)), timeout=DRAIN_S), [
        (e.id, e.redis.hgetall(keys.stats_key(e.id)), e.redis.hgetall(keys.load_key(e.id))) for e in executors
    ]

    # each client counted once, as having left
    def counted() -> dict[str, float]:
        after = _requests_by_status(gateway)
        return {s: after[s] - before.get(s, 0) for s in after if after[s] != before.get(s, 0)}

    assert eventually(lambda: sum(counted().values()) >= CLIENTS, timeout=10), counted()
    counts = counted()
    assert set(counts) <= {"499", "200"} and sum(counts.values()) == CLIENTS, counts
    # every answer a client had whole is a 200; an answer whose last bytes went out as its client closed is
    # one too, though that client never read them
    finished = sum(map(_whole_answer, (received for _, received in results)))
    assert finished <= counts.get("200", 0) <= FINISHED_AT_MOST, (finished, counts)

    lines = [json.loads(line) for line in gateway.log_path.read_bytes()[logged:].splitlines() if line]
    assert not [line for line in lines if line["level"] not in ("INFO", "WARNING")], lines
    messages = {line["message"] for line in lines}
    # the storm reached every way of leaving, the backlog among them
    assert "client disconnected while sending its request body" in messages
    held = "the client disconnected while its request waited for an executor"
    assert any(held in message for message in messages), messages

    # both executors still serve: a burst fills both
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=gateway.base, timeout=60) as client:
            bodies = [{"model": "tiny", "prompt": f"after {i}", "max_tokens": 8} for i in range(10)]
            return list(await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies)))

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200] * 10, [r.text for r in responses]
    assert {r.headers["x-kvserve-executor"] for r in responses} == {e.id for e in executors}
    assert stormed < 10
