"""What a KV block's bytes depend on besides its tokens, and who owns a tier slot.

A block's chain hash names its tokens (and its tenant's salt), not the model, dtype or layout that computed its
KV: a block file or a peer's block is usable only where all of those match, so each is stamped with the
fingerprint's digest and checked against it before a byte is used.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import msgpack

from shared.tenant import Tenant

_FINGERPRINT_VERSION = 1
# the weight files whose names and sizes stand in for their contents (hashing gigabytes at every start would not do)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


@dataclass(frozen=True, slots=True)
class KVFingerprint:
    model: str  # model_identity(path)
    dtype: str  # "float32", "bfloat16"...
    block_size: int
    block_shape: tuple[int, ...]  # a block's payload: (layers, 2, block_size, kv_heads, head_dim)
    quantization: str  # config.quantization + "/" + config.quantized_activations: both change the KV computed
    adapter: str = ""  # a LoRA adapter's name; "" for the base model

    def digest(self) -> bytes:
        """16 bytes over a canonical encoding: equal digests, interchangeable KV."""
        encoded = msgpack.packb(
            [
                _FINGERPRINT_VERSION,
                self.model,
                self.dtype,
                self.block_size,
                list(self.block_shape),
                self.quantization,
                self.adapter,
            ],
            use_bin_type=True,
        )
        return hashlib.blake2b(encoded, digest_size=16, person=b"kvserve-kvfp").digest()


def model_identity(path: Path) -> str:
    """A hex digest of the model directory's config.json and its weight files' names and sizes: a changed
    checkpoint (retrained, requantized, reconverted) makes old block files foreign."""
    h = hashlib.blake2b(digest_size=16, person=b"kvserve-model")
    config = (path / "config.json").read_bytes()
    h.update(len(config).to_bytes(8, "little") + config)
    weights = sorted(p for p in path.rglob("*") if p.suffix in _WEIGHT_SUFFIXES and p.is_file())
    h.update(msgpack.packb([[p.relative_to(path).as_posix(), p.stat().st_size] for p in weights]))
    return h.hexdigest()


def salt_digest(cache_salt: str) -> str:
    """A short hex digest of a tenant's cache salt: what a tier stores in the salt's place, since a file or a peer
    must never learn the secret itself."""
    return hashlib.blake2b(cache_salt.encode(), digest_size=8, person=b"kvserve-tier").hexdigest()


def tier_owner(tenant: Tenant) -> Tenant:
    """The tenant a tier slot belongs to: the same name and weight, the salt replaced by its digest, so that an
    executor restarted on the same directory rebuilds equal owners from the block files' headers."""
    if tenant.cache_salt is None:
        return tenant
    return Tenant(tenant.name, salt_digest(tenant.cache_salt), tenant.weight)
