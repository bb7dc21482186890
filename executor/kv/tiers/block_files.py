"""A KV block's file on disk: what it holds, and the checks that stand between its bytes and a request.

Layout: MAGIC, the header's length (4 bytes, little-endian), the header (msgpack), the payload (the block's
bytes, every layer's K and V). The header says which block it is (its chain hash), whose (the owner's name, salt
digest and weight, so a restarted executor rebuilds the tier's shares), and what computed it (the KV
fingerprint's digest), with the payload's length and checksum. A file failing any check is never served.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import msgpack

from shared.block_hash import HASH_BYTES
from shared.tenant import MAX_TENANT_WEIGHT, Tenant

MAGIC = b"KVSBLK\x00\x01"
FORMAT_VERSION = 1
SUFFIX = ".kvb"
TEMP_SUFFIX = ".kvb.tmp"  # distinct from any file of the user's that scan() might otherwise remove
CHECKSUM_BYTES = 16
FINGERPRINT_BYTES = 16
# a header's whole size (magic and length included) is at most this, so a file's size is known in advance (the
# disk capacity counts it) and a corrupt length never makes a reader allocate much
MAX_HEADER_BYTES = 1024
# a longer tenant name is kept to its first this many bytes: the owner rebuilt after a restart then differs only
# in the shares' bookkeeping, while the block's hash (salted) still decides whose requests it serves
MAX_NAME_BYTES = 512
_PREFIX = struct.Struct("<I")
PREFIX_BYTES = len(MAGIC) + _PREFIX.size  # what header_length() reads
_SALT_DIGEST_CHARS = 16  # fingerprint.salt_digest's


@dataclass(frozen=True, slots=True)
class BlockHeader:
    block_hash: bytes
    owner: Tenant  # a tier owner (fingerprint.tier_owner): its cache_salt is the salt's digest
    payload_bytes: int
    checksum: bytes
    header_bytes: int  # where the payload starts


def file_name(block_hash: bytes) -> str:
    return block_hash.hex() + SUFFIX


def file_bytes(payload_bytes: int) -> int:
    """The most a block file of this payload takes on disk."""
    return MAX_HEADER_BYTES + payload_bytes


def checksum(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=CHECKSUM_BYTES).digest()


def encode_header(block_hash: bytes, owner: Tenant, fingerprint: bytes, payload: bytes | memoryview) -> bytes:
    """The bytes a block file starts with; the payload follows them. owner must be a tier owner: the salt itself
    never goes to disk."""
    salt = owner.cache_salt
    if salt is not None and not (len(salt) == _SALT_DIGEST_CHARS and _is_hex(salt)):
        raise ValueError(
            "a block file's owner must be tier_owner(tenant): its cache_salt is not a salt digest"
        )
    name = owner.name.encode()[:MAX_NAME_BYTES].decode(errors="ignore")
    header = msgpack.packb(
        {
            "v": FORMAT_VERSION,
            "fingerprint": fingerprint,
            "hash": block_hash,
            "tenant": name,
            "salt": salt,
            "weight": float(owner.weight),
            "length": len(payload),
            "checksum": checksum(payload),
        },
        use_bin_type=True,
    )
    return MAGIC + _PREFIX.pack(len(header)) + header


def header_length(prefix: bytes) -> int | None:
    """From a file's first PREFIX_BYTES: the whole header's size, or None when the file is no block file or its
    length is out of bounds."""
    if len(prefix) != PREFIX_BYTES or not prefix.startswith(MAGIC):
        return None
    (length,) = _PREFIX.unpack_from(prefix, len(MAGIC))
    total = PREFIX_BYTES + length
    return total if total <= MAX_HEADER_BYTES else None


def parse_header(header: bytes, fingerprint: bytes) -> BlockHeader | None:
    """A block file's whole header (header_length() bytes), checked: None when it is malformed, of another format
    version, or of another fingerprint (foreign: another model, dtype, layout...)."""
    if header_length(header[:PREFIX_BYTES]) != len(header):
        return None
    try:
        fields = msgpack.unpackb(header[PREFIX_BYTES:], raw=False)
    except (ValueError, TypeError, msgpack.UnpackException):  # undecodable text included
        return None
    if (
        not isinstance(fields, dict)
        or fields.get("v") != FORMAT_VERSION
        or fields.get("fingerprint") != fingerprint
    ):
        return None
    block_hash, name, salt = fields.get("hash"), fields.get("tenant"), fields.get("salt")
    weight, length, digest = fields.get("weight"), fields.get("length"), fields.get("checksum")
    if not (
        isinstance(block_hash, bytes)
        and len(block_hash) == HASH_BYTES
        and isinstance(name, str)
        and (salt is None or isinstance(salt, str) and len(salt) == _SALT_DIGEST_CHARS and _is_hex(salt))
        and isinstance(weight, float)
        and 0 < weight <= MAX_TENANT_WEIGHT
        and isinstance(length, int)
        and length >= 0
        and isinstance(digest, bytes)
        and len(digest) == CHECKSUM_BYTES
    ):
        return None
    return BlockHeader(block_hash, Tenant(name, salt, weight), length, digest, len(header))


def payload_ok(header: BlockHeader, payload: bytes | bytearray | memoryview) -> bool:
    """The payload is whole and unchanged since it was written."""
    return len(payload) == header.payload_bytes and checksum(payload) == header.checksum


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)
