"""The pulling end of peer pulls (protocol: peer_transfer.py): KV blocks read from another executor, each checked
before the engine sees it.

A pull trusts nothing it receives: every block must be the hash asked for at its position, of the expected byte
length, with the checksum the server computed over the bytes it sent. The first failure, refusal, dead peer or
the deadline ends the pull with the contiguous blocks delivered so far; a peer's fault is never an exception.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable

import numpy as np
import torch
import zmq

from executor.kv.tiers.peer_transfer import (
    CHUNK_BYTES,
    MAX_PULL_BLOCKS,
    MAX_REPLY_HEADER_BYTES,
    Blocks,
    MessageError,
    Pull,
    checksum,
    control,
    unpack,
)
from shared.curve_keys import CurveKeys

log = logging.getLogger("kvserve.executor.kv_pull")

# "done" is worth sending (the server unpins at once rather than after LEASE_IDLE_S) but not worth waiting for:
# a socket closed with this linger lets it leave in the background, and never delays the pull
DONE_LINGER_MS = 100


class KVPuller:
    """Pulls into tensors of block_shape and dtype (the engine's KV payload); one context for every pull, one
    DEALER socket per pull, so pulls may run on several threads at once."""

    def __init__(self, block_shape: tuple[int, ...], dtype: torch.dtype, curve: CurveKeys | None) -> None:
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.block_bytes = math.prod(self.block_shape) * dtype.itemsize
        self.curve = curve
        self.context = zmq.Context()

    def pull(
        self,
        address: str,
        hashes: list[bytes],
        fingerprint: bytes,
        deadline: float,
        into: Callable[[int, torch.Tensor], None],
    ) -> int:
        """Blocks delivered through into(i, payload), contiguous from hashes[0]; stops at deadline
        (time.monotonic()). At most MAX_PULL_BLOCKS are asked for; a longer list is cut there."""
        hashes = hashes[:MAX_PULL_BLOCKS]
        if not hashes or time.monotonic() >= deadline:
            return 0
        socket = self._connect(address)
        pull_id = os.urandom(8)
        delivered = 0
        finished = False  # the server closed the lease itself (last chunk, or an error)
        try:
            timeout_s = max(deadline - time.monotonic(), 0.001)
            socket.send(Pull(pull_id, fingerprint, hashes, timeout_s).to_wire())
            while True:
                frames = _receive(socket, deadline)
                if frames is None:
                    log.info("pull from %s: no reply by the deadline, %d block(s) in", address, delivered)
                    break
                count, finished, problem = self._deliver(frames, pull_id, hashes, delivered, into)
                delivered += count
                if problem is not None:
                    log.warning("pull from %s stopped at block %d: %s", address, delivered, problem)
                    break
                if finished or delivered == len(hashes):
                    break
                socket.send(control("more", pull_id))
        except zmq.ZMQError as error:  # e.g. an address ZeroMQ cannot parse
            log.warning("pull from %s failed: %s", address, error)
        finally:
            if not finished:
                try:
                    socket.send(control("done", pull_id), zmq.NOBLOCK)
                    socket.linger = DONE_LINGER_MS
                except zmq.ZMQError:
                    pass
            socket.close()
        return delivered

    def close(self) -> None:
        self.context.destroy(linger=0)

    def _connect(self, address: str) -> zmq.Socket:
        socket = self.context.socket(zmq.DEALER)
        socket.linger = 0  # a pull that ended leaves nothing queued behind it
        socket.setsockopt(zmq.MAXMSGSIZE, max(CHUNK_BYTES, self.block_bytes, MAX_REPLY_HEADER_BYTES))
        if self.curve is not None:  # executors share one key pair: ours is also the server's
            socket.curve_secretkey = self.curve.secret
            socket.curve_publickey = self.curve.public
            socket.curve_serverkey = self.curve.public
        socket.connect(address)
        return socket

    def _deliver(
        self,
        frames: list[zmq.Frame],
        pull_id: bytes,
        hashes: list[bytes],
        delivered: int,
        into: Callable[[int, torch.Tensor], None],
    ) -> tuple[int, bool, str | None]:
        """(blocks handed to into, whether the server has closed the lease, what stopped the pull or None). The
        blocks before a bad one are still delivered."""
        try:
            message = unpack(frames[0].bytes, MAX_REPLY_HEADER_BYTES)
            if message.get("type") == "error":  # a refusal leaves no lease open
                return 0, True, f"refused: {message.get('message')!r}"
            if message.get("type") != "blocks":
                raise MessageError(f"unexpected message type {message.get('type')!r}")
            chunk = Blocks.from_wire(message)
        except MessageError as error:
            return 0, False, f"bad reply: {error}"
        if chunk.id != pull_id or chunk.start != delivered:
            return 0, False, f"a reply for pull {chunk.id.hex()} at block {chunk.start}"
        if len(frames) - 1 != len(chunk.hashes) or delivered + len(chunk.hashes) > len(hashes):
            return 0, False, f"{len(frames) - 1} payload frame(s) for {len(chunk.hashes)} hash(es)"
        for offset, (block_hash, sum_, frame) in enumerate(
            zip(chunk.hashes, chunk.checksums, frames[1:], strict=True)
        ):
            i = delivered + offset
            data = frame.buffer
            if block_hash != hashes[i]:
                return offset, False, f"block {i} is {block_hash.hex()}, not the {hashes[i].hex()} asked for"
            if data.nbytes != self.block_bytes:
                return offset, False, f"block {i} has {data.nbytes} bytes; want {self.block_bytes}"
            if checksum(data) != sum_:
                return offset, False, f"block {i}: checksum mismatch"
            into(i, self._tensor(data))
        return len(chunk.hashes), chunk.last, None

    def _tensor(self, data: memoryview) -> torch.Tensor:
        """The payload copied into a tensor of its own: the frame's buffer is read-only and dies with the frame."""
        tensor = torch.empty(self.block_shape, dtype=self.dtype)
        tensor.view(torch.uint8).reshape(-1).numpy()[:] = np.frombuffer(data, dtype=np.uint8)
        return tensor


def _receive(socket: zmq.Socket, deadline: float) -> list[zmq.Frame] | None:
    """The next reply, or None when the deadline passes first."""
    remaining_ms = math.ceil((deadline - time.monotonic()) * 1000)
    if remaining_ms <= 0 or not socket.poll(remaining_ms):
        return None
    return socket.recv_multipart(copy=False)
