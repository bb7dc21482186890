"""Peer pulls: one executor reads KV blocks another holds, over ZeroMQ. What both ends share lives here: the
interfaces the serving side reads blocks through (BlockSource, BlockLease), the messages and their bounds, and a
block payload's bytes and checksum. The server is peer_transfer_server.py, the client peer_puller.py.

Messages are multipart: one msgpack header frame, then one raw frame per block payload, so a payload is never
copied into msgpack. Every header carries "v" (VERSION), "type" and the pull's "id". The client drives the flow,
one request per chunk, so a server never queues more than one chunk for a reader that stopped reading:

    client                                              server
    {type: pull, id, fingerprint, hashes, timeout_s} -> opens one lease on the leading run of hashes it holds
                                                     <- {type: blocks, id, start, hashes, checksums, last} + payloads
    {type: more, id}                                 -> the next chunk (at most CHUNK_BYTES of payload)
    {type: done, id}                                 -> closes the lease early (the reader is done or gave up)
                                                     <- {type: error, id, message}: refused; the lease is closed

A server closes a lease after its last chunk, on "done", and when no request advanced it for LEASE_IDLE_S.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
import torch

from shared.block_hash import HASH_BYTES

VERSION = 1
MAX_PULL_BLOCKS = 8192  # hashes one pull may name: a 128k-token prompt in 16-token blocks
CHUNK_BYTES = 16 * 1024 * 1024  # payload bytes of one reply (one block more when a block alone is larger)
# pulls a server streams at once: a leased block is pinned (cannot be evicted), so this bounds what peers pin
MAX_LEASES = 4
LEASE_IDLE_S = 10.0  # a lease nobody advanced this long belongs to a reader that went away
MAX_OPEN_WAIT_S = 5.0  # the longest a server waits on its engine to open a lease, whatever the client allows
MAX_ID_BYTES = 16
CHECKSUM_BYTES = 16
# a pull's header: MAX_PULL_BLOCKS hashes of ~18 bytes in msgpack, and a few short fields
MAX_REQUEST_BYTES = 256 * 1024
# a reply's header: a hash and a checksum per block; a chunk holds at most MAX_PULL_BLOCKS blocks
MAX_REPLY_HEADER_BYTES = MAX_PULL_BLOCKS * 2 * (CHECKSUM_BYTES + 2) + 4096


class BlockLease(Protocol):
    hashes: list[bytes]  # the leading run of the asked hashes the source holds, pinned until close()

    def read(self, i: int) -> torch.Tensor:
        """The payload of hashes[i]: a CPU tensor of the block's shape and KV dtype; may be called off-thread."""
        ...

    def close(self) -> None:
        """Unpin (idempotent)."""
        ...


class BlockSource(Protocol):
    def open(self, hashes: list[bytes], timeout_s: float) -> BlockLease | None:
        """A lease on the leading run of hashes held (maybe empty); None when the source is busy or closed."""
        ...


class MessageError(ValueError):
    """A message this side cannot accept; the text says why."""


def payload_bytes(payload: torch.Tensor) -> memoryview:
    """A block's bytes without a copy (bfloat16 has no numpy dtype, so every dtype goes through uint8)."""
    return memoryview(payload.contiguous().view(torch.uint8).reshape(-1).numpy())


def checksum(data: memoryview | bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=CHECKSUM_BYTES).digest()


def pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb({"v": VERSION, **message}, use_bin_type=True)


def unpack(frame: bytes, max_bytes: int) -> dict[str, Any]:
    """A header frame as a map with a known version; max_bytes bounds what the parser will build."""
    if len(frame) > max_bytes:
        raise MessageError(f"a {len(frame)}-byte header; at most {max_bytes}")
    try:
        message = msgpack.unpackb(
            frame, raw=False, max_bin_len=max_bytes, max_str_len=max_bytes, max_array_len=max_bytes
        )
    except (ValueError, msgpack.UnpackException) as error:  # ExtraData and FormatError are ValueErrors
        raise MessageError(f"not a msgpack message: {error}") from None
    if not isinstance(message, dict):
        raise MessageError("not a msgpack map")
    if message.get("v") != VERSION:
        raise MessageError(f"protocol version {message.get('v')!r}; this side speaks {VERSION}")
    return message


def message_id(message: dict[str, Any]) -> bytes:
    value = message.get("id")
    if not isinstance(value, bytes) or not 0 < len(value) <= MAX_ID_BYTES:
        raise MessageError(f"id: want 1 to {MAX_ID_BYTES} bytes")
    return value


@dataclass(frozen=True, slots=True)
class Pull:
    id: bytes
    fingerprint: bytes
    hashes: list[bytes]
    timeout_s: float  # how long the client still waits: no point in a source's waiting longer

    def to_wire(self) -> bytes:
        return pack(
            {
                "type": "pull",
                "id": self.id,
                "fingerprint": self.fingerprint,
                "hashes": self.hashes,
                "timeout_s": self.timeout_s,
            }
        )

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> Pull:
        fingerprint, hashes, timeout_s = (message.get(k) for k in ("fingerprint", "hashes", "timeout_s"))
        if not isinstance(fingerprint, bytes) or len(fingerprint) > 64:
            raise MessageError("fingerprint: want at most 64 bytes")
        if not isinstance(hashes, list) or not 0 < len(hashes) <= MAX_PULL_BLOCKS:
            raise MessageError(f"hashes: want a list of 1 to {MAX_PULL_BLOCKS}")
        if not all(isinstance(h, bytes) and len(h) == HASH_BYTES for h in hashes):
            raise MessageError(f"hashes: each must be {HASH_BYTES} bytes")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s > 0:
            raise MessageError("timeout_s: want a number > 0")
        return cls(message_id(message), fingerprint, hashes, min(float(timeout_s), MAX_OPEN_WAIT_S))


@dataclass(frozen=True, slots=True)
class Blocks:
    """A chunk's header; its payloads follow as frames, one per hash."""

    id: bytes
    start: int  # the position of hashes[0] in the pull
    hashes: list[bytes]
    checksums: list[bytes]
    last: bool  # no chunk follows: the server closed the lease

    def to_wire(self) -> bytes:
        return pack(
            {
                "type": "blocks",
                "id": self.id,
                "start": self.start,
                "hashes": self.hashes,
                "checksums": self.checksums,
                "last": self.last,
            }
        )

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> Blocks:
        start, hashes, checksums, last = (message.get(k) for k in ("start", "hashes", "checksums", "last"))
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise MessageError("start: want an integer >= 0")
        if not isinstance(hashes, list) or not isinstance(checksums, list) or len(hashes) != len(checksums):
            raise MessageError("hashes and checksums: want two lists of one length")
        if not all(isinstance(v, bytes) for v in hashes + checksums) or not isinstance(last, bool):
            raise MessageError("hashes, checksums: want bytes; last: want a boolean")
        return cls(message_id(message), start, hashes, checksums, last)


def error_reply(request_id: bytes | None, message: str) -> bytes:
    return pack({"type": "error", "id": request_id, "message": message})


def control(kind: str, request_id: bytes) -> bytes:
    """A client's "more" or "done" for the pull request_id."""
    return pack({"type": kind, "id": request_id})
