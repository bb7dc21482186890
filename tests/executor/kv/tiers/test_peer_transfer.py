"""Peer pulls end to end over real ZeroMQ sockets on 127.0.0.1: the transfer server over a fake in-memory
BlockSource, the puller checking what arrives, CURVE keys as `kvserve curve-keys` writes them."""

from __future__ import annotations

import os
import threading
import time

import msgpack
import pytest
import torch
import zmq

from executor.kv.tiers import peer_transfer_server
from executor.kv.tiers.peer_puller import KVPuller
from executor.kv.tiers.peer_transfer import (
    MAX_LEASES,
    MAX_REQUEST_BYTES,
    Blocks,
    Pull,
    checksum,
    payload_bytes,
    unpack,
)
from executor.kv.tiers.peer_transfer_server import KVTransferServer, transfer_hosts
from kvserve.curve_keys_cli import write_keys
from shared.curve_keys import load_executor_keys, load_gateway_keys

SHAPE = (2, 2, 4, 2, 8)  # layers, K/V, block_size, kv heads, head_dim
BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 4  # float32
FINGERPRINT = bytes(range(16))
LOCAL = "tcp://127.0.0.1:*"


def make_hashes(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


class FakeLease:
    def __init__(self, source: FakeSource, hashes: list[bytes]) -> None:
        self.source, self.hashes, self.closed = source, hashes, False

    def read(self, i: int) -> torch.Tensor:
        if self.hashes[i] in self.source.unreadable:
            raise LookupError("failed its checks on disk")
        return self.source.blocks[self.hashes[i]]

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.source.closes += 1


class FakeSource:
    """A BlockSource over a dict hash -> payload; counts leases; `hang` makes open() wait as an engine stuck in a
    long step would, up to the time it is given."""

    def __init__(self, blocks: dict[bytes, torch.Tensor]) -> None:
        self.blocks = blocks
        self.opens = self.closes = 0
        self.unreadable: set[bytes] = set()  # held, but its read fails (a disk file found corrupt)
        self.hang = threading.Event()

    def open(self, hashes: list[bytes], timeout_s: float) -> FakeLease | None:
        if self.hang.is_set():
            time.sleep(timeout_s)
            return None
        run = []
        for block_hash in hashes:
            if block_hash not in self.blocks:
                break
            run.append(block_hash)
        self.opens += 1
        return FakeLease(self, run)

    def wait_all_closed(self, timeout_s: float = 2.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.closes != self.opens and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.closes == self.opens


def random_blocks(hashes: list[bytes], dtype: torch.dtype = torch.float32) -> dict[bytes, torch.Tensor]:
    return {h: torch.randn(SHAPE).to(dtype) for h in hashes}


@pytest.fixture
def serve():
    """serve(source, curve=None, **kw) -> a started server, closed after the test."""
    servers = []

    def start(source, curve=None, **kw) -> KVTransferServer:
        server = KVTransferServer(LOCAL, FINGERPRINT, source, curve, **kw)
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


@pytest.fixture
def small_chunks(monkeypatch):
    """Four blocks a chunk, so a few dozen blocks take many round trips."""
    monkeypatch.setattr(peer_transfer_server, "CHUNK_BYTES", 4 * BLOCK_BYTES)


def pull(puller, address, hashes, fingerprint=FINGERPRINT, timeout_s=5.0):
    """(blocks delivered, what into() got by index)."""
    got: dict[int, torch.Tensor] = {}
    count = puller.pull(address, hashes, fingerprint, time.monotonic() + timeout_s, got.__setitem__)
    return count, got


@pytest.fixture
def dealer():
    """dealer(address, curve=None) -> a raw DEALER socket, to say what a KVPuller never would."""
    context = zmq.Context()

    def connect(address: str, curve: tuple[bytes, bytes, bytes] | None = None) -> zmq.Socket:
        socket = context.socket(zmq.DEALER)
        socket.linger = 0
        if curve is not None:
            socket.curve_secretkey, socket.curve_publickey, socket.curve_serverkey = curve
        socket.connect(address)
        return socket

    yield connect
    context.destroy(linger=0)


def raw_pull(pull_id: bytes, hashes: list[bytes]) -> bytes:
    return Pull(pull_id, FINGERPRINT, hashes, 1.0).to_wire()


@pytest.fixture
def puller():
    p = KVPuller(SHAPE, torch.float32, None)
    yield p
    p.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_blocks_cross_several_chunks_unchanged(serve, small_chunks, dtype):
    hashes = make_hashes(50)
    source = FakeSource(random_blocks(hashes, dtype))
    server = serve(source)
    puller = KVPuller(SHAPE, dtype, None)
    try:
        count, got = pull(puller, server.address, hashes)
    finally:
        puller.close()
    assert count == 50 and sorted(got) == list(range(50))
    for i, block_hash in enumerate(hashes):
        assert got[i].dtype == dtype and torch.equal(got[i], source.blocks[block_hash])
    assert source.opens == 1 and source.wait_all_closed()


def test_a_partial_run_delivers_what_the_server_holds(serve, small_chunks, puller):
    hashes = make_hashes(12)
    source = FakeSource(random_blocks(hashes[:7]))
    server = serve(source)
    count, got = pull(puller, server.address, hashes)
    assert count == 7 and sorted(got) == list(range(7))
    assert source.wait_all_closed()


def test_an_unreadable_block_ends_the_run_the_server_sends(serve, small_chunks, puller):
    hashes = make_hashes(12)
    source = FakeSource(random_blocks(hashes))
    source.unreadable.add(hashes[6])
    server = serve(source)
    started = time.monotonic()
    count, got = pull(puller, server.address, hashes)
    assert count == 6 and sorted(got) == list(range(6))
    assert time.monotonic() - started < 2.0 and source.wait_all_closed()


def test_a_block_the_server_lacks_first_delivers_nothing(serve, puller):
    hashes = make_hashes(3)
    source = FakeSource(random_blocks(hashes[1:]))
    count, got = pull(puller, serve(source).address, hashes)
    assert count == 0 and not got and source.wait_all_closed()


def test_a_different_fingerprint_is_refused_before_any_lease(serve, puller):
    hashes = make_hashes(3)
    source = FakeSource(random_blocks(hashes))
    server = serve(source)
    started = time.monotonic()
    count, _ = pull(puller, server.address, hashes, fingerprint=b"another model...")
    assert count == 0 and source.opens == 0
    assert time.monotonic() - started < 2.0  # refused at once, not by the deadline


@pytest.mark.parametrize("fault", ["checksum", "hash", "length"])
def test_a_bad_block_ends_the_pull_there(puller, fault):
    """A server that lies about its third block: the first two arrive, the rest never does."""
    hashes = make_hashes(5)
    blocks = random_blocks(hashes)
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    got: dict[int, torch.Tensor] = {}
    result = []
    thread = threading.Thread(
        target=lambda: result.append(
            puller.pull(f"tcp://127.0.0.1:{port}", hashes, FINGERPRINT, time.monotonic() + 5, got.__setitem__)
        )
    )
    thread.start()
    try:
        assert router.poll(5000)
        identity, header = router.recv_multipart()
        request = unpack(header, MAX_REQUEST_BYTES)
        payloads = [bytes(payload_bytes(blocks[h])) for h in hashes]
        sums = [checksum(p) for p in payloads]
        sent = list(hashes)
        if fault == "checksum":
            payloads[2] = payloads[2][:-1] + bytes([payloads[2][-1] ^ 1])  # flipped after the checksum
        elif fault == "hash":
            sent[2] = os.urandom(16)
        else:
            payloads[2] = payloads[2][:-4]
        reply = Blocks(request["id"], 0, sent, sums, True).to_wire()
        router.send_multipart([identity, reply, *payloads])
        thread.join(5)
    finally:
        router.close(linger=0)
        context.term()
    assert result == [2] and sorted(got) == [0, 1]


def test_a_source_that_hangs_costs_the_deadline_and_no_more(serve, puller):
    hashes = make_hashes(3)
    source = FakeSource(random_blocks(hashes))
    source.hang.set()
    server = serve(source)
    started = time.monotonic()
    count, _ = pull(puller, server.address, hashes, timeout_s=0.5)
    assert count == 0 and time.monotonic() - started < 0.5 + 0.3


def test_a_server_closed_mid_pull_leaves_the_blocks_delivered(serve, small_chunks, puller):
    hashes = make_hashes(20)
    source = FakeSource(random_blocks(hashes))
    server = serve(source)
    got: dict[int, torch.Tensor] = {}

    def into(i: int, payload: torch.Tensor) -> None:
        got[i] = payload
        if i == 3:  # the first chunk's last block: the server goes before the client asks for more
            server.close()

    count = puller.pull(server.address, hashes, FINGERPRINT, time.monotonic() + 1.0, into)
    assert count == 4 and sorted(got) == [0, 1, 2, 3]
    assert source.opens == 1 and source.closes == 1


def test_a_reader_that_stops_asking_loses_its_lease_after_the_idle_time(serve, small_chunks, dealer):
    hashes = make_hashes(20)
    source = FakeSource(random_blocks(hashes))
    socket = dealer(serve(source, lease_idle_s=0.2).address)
    socket.send(raw_pull(b"x", hashes))
    assert socket.poll(2000)
    socket.recv_multipart()
    assert source.opens == 1 and source.closes == 0
    assert source.wait_all_closed(2.0)


def test_more_pulls_than_leases_are_refused_not_queued(serve, small_chunks, puller, dealer):
    hashes = make_hashes(20)
    source = FakeSource(random_blocks(hashes))
    server = serve(source)
    for n in range(MAX_LEASES):  # each holds a lease open, reading nothing after its first chunk
        socket = dealer(server.address)
        socket.send(raw_pull(bytes([n + 1]), hashes))
        assert socket.poll(2000)
        socket.recv_multipart()
    started = time.monotonic()
    count, _ = pull(puller, server.address, hashes)
    assert count == 0 and time.monotonic() - started < 2.0
    assert source.opens == MAX_LEASES
    server.close()
    assert source.closes == MAX_LEASES  # close() lets every lease go


@pytest.mark.parametrize(
    "frames",
    [
        [b"not msgpack \xc1"],
        [msgpack.packb([1, 2])],
        [msgpack.packb({"v": 9, "type": "pull", "id": b"x"})],
        [Pull(b"x", FINGERPRINT, [b"short"], 1.0).to_wire()],
        [msgpack.packb({"v": 1, "type": "launch", "id": b"x"})],
        [msgpack.packb({"v": 1, "type": "more", "id": b"nope"})],
        [msgpack.packb({"v": 1, "type": "more", "id": b"x"}), b"extra frame"],
    ],
)
def test_a_bad_message_gets_an_error_and_the_server_serves_on(serve, puller, dealer, frames):
    hashes = make_hashes(2)
    server = serve(FakeSource(random_blocks(hashes)))
    socket = dealer(server.address)
    socket.send_multipart(frames)
    assert socket.poll(2000)
    reply = unpack(socket.recv_multipart()[0], MAX_REQUEST_BYTES)
    assert reply["type"] == "error" and reply["message"]
    assert pull(puller, server.address, hashes)[0] == 2


def test_an_oversized_message_is_dropped_and_the_server_serves_on(serve, puller, dealer):
    hashes = make_hashes(2)
    server = serve(FakeSource(random_blocks(hashes)))
    socket = dealer(server.address)
    socket.send(b"\x00" * (MAX_REQUEST_BYTES + 1))  # ZMQ_MAXMSGSIZE: the connection goes, nothing is read
    assert not socket.poll(300)
    assert pull(puller, server.address, hashes)[0] == 2


@pytest.fixture
def curve_dir(tmp_path):
    write_keys(tmp_path / "keys")
    return tmp_path / "keys"


def test_curve_lets_in_the_executor_key_alone(serve, curve_dir):
    executor_keys = load_executor_keys(curve_dir)
    gateway_keys = load_gateway_keys(curve_dir)
    hashes = make_hashes(3)
    source = FakeSource(random_blocks(hashes))
    server = serve(source, curve=executor_keys)
    pullers = {
        "executor": KVPuller(SHAPE, torch.float32, executor_keys),
        "gateway": KVPuller(SHAPE, torch.float32, gateway_keys),
        "none": KVPuller(SHAPE, torch.float32, None),
    }
    try:
        assert pull(pullers["executor"], server.address, hashes)[0] == 3
        for name in ("gateway", "none"):
            started = time.monotonic()
            assert pull(pullers[name], server.address, hashes, timeout_s=0.5)[0] == 0, name
            assert time.monotonic() - started < 0.5 + 0.3
    finally:
        for p in pullers.values():
            p.close()
    assert source.opens == 1


def test_curve_refuses_a_key_that_knows_the_server_but_is_not_the_executors(serve, curve_dir, dealer):
    """The ZAP check itself: a gateway's key pair aimed at the right server key gets no reply."""
    executor_keys = load_executor_keys(curve_dir)
    gateway = load_gateway_keys(curve_dir)
    hashes = make_hashes(1)
    source = FakeSource(random_blocks(hashes))
    server = serve(source, curve=executor_keys)
    socket = dealer(server.address, (gateway.secret, gateway.public, executor_keys.public))
    socket.send(raw_pull(b"x", hashes))
    assert not socket.poll(500)
    assert source.opens == 0


@pytest.mark.parametrize(
    "bind, advertise, host, expected",
    [
        ("tcp://10.0.0.5:5600", None, None, ("10.0.0.5", "10.0.0.5")),
        ("tcp://0.0.0.0:5600", "tcp://exec-1:5600", None, ("0.0.0.0", "exec-1")),
        ("tcp://0.0.0.0:5600", "tcp://exec-1:5600", "10.0.0.7", ("10.0.0.7", "10.0.0.7")),
        ("tcp://127.0.0.1:5600", "tcp://exec-1:5600", "0.0.0.0", ("0.0.0.0", "exec-1")),
        ("tcp://[::1]:5600", None, None, ("::1", "::1")),
        ("ipc:///tmp/executor", None, None, ("127.0.0.1", "127.0.0.1")),
    ],
)
def test_transfer_hosts_follow_the_executors_addresses(bind, advertise, host, expected):
    assert transfer_hosts(bind, advertise, host) == expected


def test_the_executor_publishes_a_connectable_address_and_its_fingerprint(puller):
    hashes = make_hashes(2)
    server, info = peer_transfer_server.start_executor_transfers(
        FakeSource(random_blocks(hashes)), FINGERPRINT, "127.0.0.1", "localhost", 0, None
    )
    try:
        assert info["kv_fingerprint"] == FINGERPRINT.hex()
        assert info["kv_transfer_address"].startswith("tcp://localhost:")
        assert pull(puller, info["kv_transfer_address"], hashes)[0] == 2
    finally:
        server.close()
