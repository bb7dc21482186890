"""Chained hashes of full KV blocks: the one function gateway and executor both use.

A block's hash covers its own tokens and, through its parent, every token before it, so equal hashes mean
equal prefixes. The chain starts from the tenant's cache salt: tenants never share, or probe, each other's cache.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_BYTES = 16
_ROOT_DOMAIN = b"kvserve-block-hash-v1"


def root_hash(cache_salt: str | bytes | None = None) -> bytes:
    """The parent of a chain's first block; differs per salt."""
    salt = cache_salt.encode() if isinstance(cache_salt, str) else (cache_salt or b"")
    return hashlib.blake2b(_ROOT_DOMAIN + b"\x00" + salt, digest_size=HASH_BYTES).digest()


def adapter_salt(cache_salt: str | bytes | None, adapter: str | None) -> str | bytes | None:
    """The salt a chain starts from for a request run under a LoRA adapter (its identity, name and digest): no
    block is shared between adapters, or with the base model, whose chains start from cache_salt alone."""
    if adapter is None:
        return cache_salt
    salt = cache_salt.encode() if isinstance(cache_salt, str) else (cache_salt or b"")
    return struct.pack("<I", len(salt)) + salt + b"lora\x00" + adapter.encode()


def hash_block(parent: bytes, token_ids: Sequence[int], extras: bytes = b"") -> bytes:
    """h_i = H(h_{i-1}, tokens_i, extras)."""
    h = hashlib.blake2b(parent, digest_size=HASH_BYTES)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(struct.pack("<I", len(extras)) + extras)
    return h.digest()


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | bytes | None = None,
    parent_hashes: Sequence[bytes] = (),
) -> list[bytes]:
    """Hashes of every full block of token_ids; parent_hashes are already-known leading hashes to extend."""
    hashes = list(parent_hashes)
    parent = hashes[-1] if hashes else root_hash(cache_salt)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def max_cached_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading blocks a prefix-cache hit may cover: never the last token, whose logits are needed."""
    return (num_tokens - 1) // block_size
