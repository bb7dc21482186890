"""The serving end of peer pulls (protocol: peer_transfer.py): a thread with a ROUTER socket that streams the
blocks an engine's BlockSource holds to the executors that ask, a chunk per request.

One thread serves every pull, interleaved a chunk at a time, so nothing here needs a lock and a slow reader costs
the others only its turns. What a client can make it hold is bounded: MAX_LEASES pulls at once, MAX_PULL_BLOCKS
blocks each, one chunk (CHUNK_BYTES) queued per pull, and a lease idle for LEASE_IDLE_S is closed. A bad message
is answered with an error and never ends the thread.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator

from executor.kv.tiers.peer_transfer import (
    CHUNK_BYTES,
    LEASE_IDLE_S,
    MAX_LEASES,
    MAX_PULL_BLOCKS,
    MAX_REQUEST_BYTES,
    BlockLease,
    Blocks,
    BlockSource,
    MessageError,
    Pull,
    checksum,
    error_reply,
    message_id,
    payload_bytes,
    unpack,
)
from executor.service.gateway_auth import RefusalLog
from shared.command_line import zmq_host
from shared.curve_keys import CurveKeys, secure_server

log = logging.getLogger("kvserve.executor.kv_transfer")

POLL_MS = 50  # how soon the thread notices close() and idle leases
CLOSE_WAIT_S = 2.0  # close() waits this long for the thread, which may be inside the source's open()
WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "")


@dataclass(slots=True)
class _Stream:
    """One pull being served: its lease and how far the client has read it."""

    lease: BlockLease
    next: int
    active_at: float  # time.monotonic() of the last request that advanced it


class _ExecutorKey:
    """ZAP credentials: only the executors' shared public key may pull; a gateway's key may not."""

    def __init__(self, public: bytes) -> None:
        self.public = public
        self.refusals = RefusalLog()

    def callback(self, domain: str, key: bytes) -> bool:
        if key == self.public:
            return True
        self.refusals.refused(
            f"KV transfer: CURVE public key {key.decode(errors='replace')} is not the executor key"
        )
        return False


class KVTransferServer:
    """Bound on construction (so a port in use fails at start-up and `address` holds the resolved port); serves
    from start() until close()."""

    def __init__(
        self,
        bind: str,
        fingerprint: bytes,
        source: BlockSource,
        curve: CurveKeys | None,
        lease_idle_s: float = LEASE_IDLE_S,
    ) -> None:
        self.fingerprint = fingerprint
        self.source = source
        self.lease_idle_s = lease_idle_s
        # by (client identity, pull id), so no client can read or end another's; touched by the thread alone
        self.streams: dict[tuple[bytes, bytes], _Stream] = {}
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.linger = 0  # a reply to a client that left is worth nothing at close
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self.authenticator = None
        if curve is not None:
            self.authenticator = ThreadAuthenticator(
                self.context, log=logging.getLogger("kvserve.executor.zap")
            )
            self.authenticator.start()
            self.authenticator.configure_curve_callback("*", _ExecutorKey(curve.public))
            secure_server(self.socket, curve)
        try:
            self.socket.bind(bind)
        except zmq.ZMQError:
            self._release()
            raise
        self.address: str = self.socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kv-transfer", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        """Stop serving (idempotent); the thread closes every open lease on its way out."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self.thread.is_alive():
            self.thread.join(CLOSE_WAIT_S)
            if self.thread.is_alive():  # stuck in the source: the daemon thread ends with the process
                log.warning("the KV transfer thread did not stop within %.0f s", CLOSE_WAIT_S)
                return
        else:
            self._close_streams()
            self.socket.close(linger=0)
        self._release()

    def _release(self) -> None:
        if self.authenticator is not None:
            self.authenticator.stop()
        self.context.destroy(linger=0)

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                if self.socket.poll(POLL_MS):
                    self._receive()
                self._expire_idle()
        finally:
            self._close_streams()
            self.socket.close(linger=0)

    def _receive(self) -> None:
        """One client message: its identity and header kept, any further frames drained unread."""
        identity = self.socket.recv()
        header = self.socket.recv() if self.socket.getsockopt(zmq.RCVMORE) else b""
        extra = 0
        while self.socket.getsockopt(zmq.RCVMORE):
            self.socket.recv()
            extra += 1
        request_id = None
        try:
            if extra:
                raise MessageError(f"{extra} frame(s) after the header; a request is one frame")
            message = unpack(header, MAX_REQUEST_BYTES)
            request_id = message_id(message)
            self._handle(identity, message, request_id)
        except MessageError as error:
            self._send(identity, [error_reply(request_id, str(error))])
        except Exception as error:  # the source's fault: this pull fails, the server goes on
            log.exception("KV transfer: serving pull %s failed", request_id.hex() if request_id else "?")
            if request_id is not None:
                self._end((identity, request_id))
            self._send(identity, [error_reply(request_id, f"the server failed: {type(error).__name__}")])

    def _handle(self, identity: bytes, message: dict, request_id: bytes) -> None:
        kind = message.get("type")
        key = (identity, request_id)
        if kind == "pull":
            self._open(identity, Pull.from_wire(message))
        elif kind == "more":
            stream = self.streams.get(key)
            if stream is None:
                raise MessageError(
                    f"no open pull {request_id.hex()} (finished, or idle over {self.lease_idle_s:g} s)"
                )
            self._send_chunk(identity, request_id, stream)
        elif kind == "done":
            self._end(key)  # the client reads nothing more: no reply
        else:
            raise MessageError(f"unknown message type {kind!r}")

    def _open(self, identity: bytes, pull: Pull) -> None:
        if pull.fingerprint != self.fingerprint:
            raise MessageError(
                "fingerprint differs: this executor's KV is of another model, dtype, quantization or block layout"
            )
        if (identity, pull.id) in self.streams:
            raise MessageError(f"pull {pull.id.hex()} is already open")
        if len(self.streams) >= MAX_LEASES:
            raise MessageError(f"busy: {MAX_LEASES} pulls are streaming; retry later or recompute")
        lease = self.source.open(pull.hashes, pull.timeout_s)
        if lease is None:
            raise MessageError("busy: the engine could not open a lease in time")
        if lease.hashes != pull.hashes[: len(lease.hashes)]:
            lease.close()
            raise RuntimeError("the block source leased hashes other than the leading run asked for")
        stream = _Stream(lease, 0, time.monotonic())
        self.streams[(identity, pull.id)] = stream
        self._send_chunk(identity, pull.id, stream)

    def _send_chunk(self, identity: bytes, request_id: bytes, stream: _Stream) -> None:
        """The next blocks, up to CHUNK_BYTES of payload (at least one block); the lease closes after the last."""
        hashes = stream.lease.hashes
        start = stream.next
        payloads: list[memoryview] = []
        size = 0
        last = False
        while stream.next < len(hashes) and len(payloads) < MAX_PULL_BLOCKS:
            try:
                payload = payload_bytes(stream.lease.read(stream.next))
            except Exception as error:  # e.g. a disk file that failed its checks: the run ends before it
                log.warning(
                    "KV transfer: block %s unreadable, pull ends there: %s", hashes[stream.next].hex(), error
                )
                last = True
                break
            payloads.append(payload)
            stream.next += 1
            size += payload.nbytes
            if size + payload.nbytes > CHUNK_BYTES:  # blocks are one size: the next would not fit
                break
        last = last or stream.next == len(hashes)
        header = Blocks(
            request_id, start, hashes[start : start + len(payloads)], [checksum(p) for p in payloads], last
        )
        # copy=True: the bytes are copied out before the lease (and with it the slot) can be let go
        self._send(identity, [header.to_wire(), *payloads])
        stream.active_at = time.monotonic()
        if last:
            self._end((identity, request_id))

    def _send(self, identity: bytes, frames: list) -> None:
        try:
            self.socket.send_multipart([identity, *frames], copy=True)
        except zmq.ZMQError as error:  # e.g. ZMQ_SNDHWM reached for a client that stopped reading
            log.warning("KV transfer: a reply was not sent: %s", error)

    def _end(self, key: tuple[bytes, bytes]) -> None:
        stream = self.streams.pop(key, None)
        if stream is not None:
            stream.lease.close()

    def _expire_idle(self) -> None:
        now = time.monotonic()
        for key in [k for k, s in self.streams.items() if now - s.active_at > self.lease_idle_s]:
            log.info("KV transfer: closing pull %s, idle for %.0f s", key[1].hex(), self.lease_idle_s)
            self._end(key)

    def _close_streams(self) -> None:
        for key in list(self.streams):
            self._end(key)


def transfer_hosts(bind: str, advertise: str | None, host: str | None) -> tuple[str, str]:
    """(the host to bind, the host to publish) for `kvserve executor`'s --kv-transfer-host: by default the host
    of --bind, so pulls are as reachable as requests are, published under the host of --advertise-address (else
    --bind); a --kv-transfer-host naming one interface is published as it is."""
    executor_host = zmq_host(bind) or "127.0.0.1"
    bind_host = executor_host if host is None else host
    if host is not None and host not in WILDCARD_HOSTS:
        return bind_host, host
    return bind_host, (zmq_host(advertise) if advertise else None) or executor_host


def tcp_endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def start_executor_transfers(
    source: BlockSource,
    fingerprint: bytes,
    bind_host: str,
    publish_host: str,
    port: int,
    curve: CurveKeys | None,
) -> tuple[KVTransferServer, dict[str, str]]:
    """`kvserve executor --kv-transfer-port`: the server started, and what its registration in Redis gains."""
    server = KVTransferServer(tcp_endpoint(bind_host, port), fingerprint, source, curve)
    server.start()
    bound_port = int(server.address.rsplit(":", 1)[1])
    registration = {
        "kv_transfer_address": tcp_endpoint(publish_host, bound_port),
        "kv_fingerprint": fingerprint.hex(),
    }
    return server, registration
