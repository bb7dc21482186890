"""Tenants' API keys in Redis: the CLI creates and revokes them (sync client), the gateway authenticates
every request with them (asyncio client).

A key reads `kvs_<key_id>_<secret>`. The key id (16 hex characters) is public: `kvserve keys list` shows it and
`revoke` takes it. Redis keeps only the secret's SHA-256, never the key, so a copy of Redis lets nobody in.
Each record carries its tenant's cache salt, so authenticating a request is a single HGETALL.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis

from shared import redis_keys
from shared.adapter_names import check_adapter_name
from shared.tenant import MAX_TENANT_WEIGHT

KEY_PREFIX = "kvs_"
_KEY_ID = re.compile(r"[0-9a-f]{16}")
_KEY = re.compile(r"kvs_([0-9a-f]{16})_([A-Za-z0-9_-]{16,128})")  # the secret is secrets.token_urlsafe
_TENANT = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # it becomes part of Redis keys and Prometheus labels
LIMITS = ("rpm", "tpm", "max_concurrency")
# a tenant's usage counters (gateway.tenants.rate_limits counts them; docs/tenancy.md says what each means), in the order
# `kvserve keys usage` shows them; all integers but kv_block_seconds
USAGE_COUNTERS = (
    "requests",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "cached_tokens_pool",  # cached_tokens by where their KV came from (shared.cache_sources); they sum to it
    "cached_tokens_host",
    "cached_tokens_disk",
    "cached_tokens_peer",
    "computed_prompt_tokens",
    "kv_block_seconds",
    "rejected",
)
FLOAT_USAGE_COUNTERS = frozenset({"kv_block_seconds"})
# a request under a LoRA adapter counts these again as `<counter>:adapter:<name>` (adapter_usage)
ADAPTER_USAGE_COUNTERS = ("requests", "prompt_tokens", "completion_tokens")
ADAPTER_USAGE = ":adapter:"
MAX_KEY_ADAPTERS = 256  # adapters one key may own: as many as the executors serve loaded at run time


UNCHANGED = object()  # KeyStore.update: a field left as it is


@dataclass(slots=True, frozen=True)
class KeyRecord:
    key_id: str
    tenant: str
    cache_salt: str  # the tenant's secret (same for every key of a tenant)
    rpm: int | None  # requests per minute; None = unlimited
    tpm: int | None  # tokens (prompt + completion) per minute
    max_concurrency: int | None
    models: tuple[str, ...] | None  # None = every model
    created_at: float
    revoked_at: float | None = None
    # the tenant's share of each engine step and of the KV cache, relative to other tenants' (default 1)
    weight: float = 1.0
    # the LoRA adapters it may use beside the base model (none: the base model only)
    adapters: tuple[str, ...] = ()
    operator: bool = (
        False  # it may load and unload adapters (POST /v1/load_lora_adapter, /v1/unload_lora_adapter)
    )


def new_key() -> tuple[str, str, str]:
    """(the full key, its key id, its secret)."""
    key_id, secret = secrets.token_hex(8), secrets.token_urlsafe(32)
    return f"{KEY_PREFIX}{key_id}_{secret}", key_id, secret


def key_id_of(key_id_or_key: str) -> str | None:
    """The key id in a key id or a full key; None when the text is neither."""
    if _KEY_ID.fullmatch(key_id_or_key):
        return key_id_or_key
    match = _KEY.fullmatch(key_id_or_key)
    return match.group(1) if match else None


def check_tenant(tenant: str) -> str:
    if not isinstance(tenant, str) or not _TENANT.fullmatch(tenant):
        raise ValueError(f"tenant: {tenant!r} must be 1-64 of A-Z a-z 0-9 _ . -")
    return tenant


def check_limit(name: str, value: int | None) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name}: {value!r} must be a positive integer (or unset for no limit)")
    return value


def check_weight(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_TENANT_WEIGHT:
        raise ValueError(f"weight: {value!r} must be a number in (0, {MAX_TENANT_WEIGHT:g}]")
    return float(value)


def parse_models(text: str | None) -> tuple[str, ...] | None:
    """ "a,b" -> ("a", "b"); None or "" -> None (every model)."""
    if text is None or not text.strip():
        return None
    models = tuple(name.strip() for name in text.split(","))
    if not all(models):
        raise ValueError(f"models: {text!r} has an empty name; give comma-separated model names")
    return models


def check_models(models: tuple[str, ...] | list[str] | None) -> tuple[str, ...] | None:
    if models is None:
        return None
    models = tuple(models)
    if not models or not all(isinstance(m, str) and m.strip() and "," not in m for m in models):
        raise ValueError(
            f"models: {models!r} must be non-empty model names without commas (or unset for all)"
        )
    return models


def parse_adapters(text: str | None) -> tuple[str, ...]:
    """ "a,b" -> ("a", "b"), each name checked; None or "" -> () (the base model only)."""
    if text is None or not text.strip():
        return ()
    return check_adapters([name.strip() for name in text.split(",")])


def check_adapters(names: tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    if names is None:
        return ()
    if not isinstance(names, list | tuple) or len(names) > MAX_KEY_ADAPTERS:
        raise ValueError(f"adapters: at most {MAX_KEY_ADAPTERS} adapter names, got {names!r:.200}")
    return tuple(dict.fromkeys(check_adapter_name(name, "adapters") for name in names))


def _secret_hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _text(value: Any) -> str:
    """Clients with and without decode_responses both serve."""
    return value.decode() if isinstance(value, bytes) else value


def _decoded(fields: dict) -> dict[str, str]:
    return {_text(k): _text(v) for k, v in fields.items()}


def _optional_int(text: str) -> int | None:
    return int(text) if text else None


def parse_record(key_id: str, fields: dict[str, str]) -> KeyRecord:
    return KeyRecord(
        key_id=key_id,
        tenant=fields["tenant"],
        cache_salt=fields["cache_salt"],
        rpm=_optional_int(fields["rpm"]),
        tpm=_optional_int(fields["tpm"]),
        max_concurrency=_optional_int(fields["max_concurrency"]),
        models=tuple(fields["models"].split(",")) if fields["models"] else None,
        created_at=float(fields["created_at"]),
        revoked_at=float(fields["revoked_at"]) if fields["revoked_at"] else None,
        weight=float(fields.get("weight") or 1.0),  # keys made before weights have none
        adapters=tuple(fields["adapters"].split(",")) if fields.get("adapters") else (),
        operator=fields.get("operator") == "1",
    )


def record_fields(record: KeyRecord, secret_sha256: str) -> dict[str, str]:
    """A key's Redis hash: what parse_record reads back."""
    limits = {name: getattr(record, name) for name in LIMITS}
    return {
        "secret_sha256": secret_sha256,
        "tenant": record.tenant,
        "cache_salt": record.cache_salt,
        **{name: "" if value is None else str(value) for name, value in limits.items()},
        "models": ",".join(record.models) if record.models else "",
        "created_at": repr(record.created_at),
        "revoked_at": "" if record.revoked_at is None else repr(record.revoked_at),
        "weight": repr(record.weight),
        # only when set: a key made before adapters reads back as it is held
        **({"adapters": ",".join(record.adapters)} if record.adapters else {}),
        **({"operator": "1"} if record.operator else {}),
    }


class KeyStore:
    """Create, list and revoke keys and read tenants' usage; the CLI's side of the key records."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def create(
        self,
        tenant: str,
        rpm: int | None = None,
        tpm: int | None = None,
        max_concurrency: int | None = None,
        models: tuple[str, ...] | list[str] | None = None,
        weight: float = 1.0,
        adapters: tuple[str, ...] | list[str] | None = None,
        operator: bool = False,
    ) -> tuple[str, KeyRecord]:
        """(the full key, to show once, and its record)."""
        check_tenant(tenant)
        limits = {
            name: check_limit(name, value)
            for name, value in zip(LIMITS, (rpm, tpm, max_concurrency), strict=True)
        }
        models = check_models(models)
        weight = check_weight(weight)
        adapters = check_adapters(adapters)
        with self.client.pipeline() as pipe:  # MULTI: a tenant's first two keys race to the same salt
            pipe.hsetnx(redis_keys.tenant_key(tenant), "cache_salt", secrets.token_hex(32))
            pipe.hget(redis_keys.tenant_key(tenant), "cache_salt")
            _, salt = pipe.execute()
        key, key_id, secret = new_key()
        record = KeyRecord(
            key_id,
            tenant,
            _text(salt),
            **limits,
            models=models,
            created_at=time.time(),
            weight=weight,
            adapters=adapters,
            operator=bool(operator),
        )
        with self.client.pipeline() as pipe:
            pipe.hset(redis_keys.api_key_key(key_id), mapping=record_fields(record, _secret_hash(secret)))
            pipe.sadd(redis_keys.API_KEYS, key_id)
            mark_keyed(pipe)
            pipe.execute()
        return key, record

    def list(self, tenant: str | None = None) -> list[KeyRecord]:
        """Every key (revoked ones too) of one tenant or of all, newest first."""
        prefix = redis_keys.api_key_key("")
        key_ids = sorted({_text(k).removeprefix(prefix) for k in self.client.scan_iter(match=prefix + "*")})
        with self.client.pipeline(transaction=False) as pipe:
            for key_id in key_ids:
                pipe.hgetall(redis_keys.api_key_key(key_id))
            rows = pipe.execute()
        records = [
            parse_record(key_id, _decoded(fields))
            for key_id, fields in zip(key_ids, rows, strict=True)
            if fields
        ]
        if tenant is not None:
            records = [r for r in records if r.tenant == tenant]
        return sorted(records, key=lambda r: r.created_at, reverse=True)

    def update(
        self,
        key_id_or_key: str,
        models: tuple[str, ...] | list[str] | None | object = UNCHANGED,
        adapters: tuple[str, ...] | list[str] | None | object = UNCHANGED,
        operator: bool | object = UNCHANGED,
    ) -> KeyRecord | None:
        """Change what a key may use (its models, its adapters, whether it is an operator's); None when no such
        key. Its requests see the change from their next request: each reads its record."""
        key_id = key_id_of(key_id_or_key)
        if key_id is None:
            return None
        changes: dict[str, object] = {}
        if models is not UNCHANGED:
            changes["models"] = check_models(models)
        if adapters is not UNCHANGED:
            changes["adapters"] = check_adapters(adapters)
        if operator is not UNCHANGED:
            changes["operator"] = bool(operator)
        record_key = redis_keys.api_key_key(key_id)
        with self.client.pipeline() as pipe:  # optimistic: a concurrent update or revoke starts it again
            while True:
                try:
                    pipe.watch(record_key)
                    fields = _decoded(pipe.hgetall(record_key))
                    if not fields:
                        return None
                    record = dataclasses.replace(parse_record(key_id, fields), **changes)
                    pipe.multi()
                    pipe.hdel(record_key, "adapters", "operator")
                    pipe.hset(record_key, mapping=record_fields(record, fields["secret_sha256"]))
                    pipe.execute()
                    return record
                except redis.WatchError:
                    continue

    def revoke(self, key_id_or_key: str) -> KeyRecord | None:
        """Revoke by key id or full key; None when no such key. Revoking twice keeps the first time."""
        key_id = key_id_of(key_id_or_key)
        if key_id is None:
            return None
        record_key = redis_keys.api_key_key(key_id)
        fields = _decoded(self.client.hgetall(record_key))
        if not fields:
            return None
        if not fields["revoked_at"]:
            fields["revoked_at"] = repr(time.time())
            with self.client.pipeline() as pipe:
                pipe.hset(record_key, "revoked_at", fields["revoked_at"])
                pipe.srem(redis_keys.API_KEYS, key_id)
                mark_keyed(
                    pipe
                )  # keys made before the marker existed: the last one's revocation must not open
                pipe.execute()
        return parse_record(key_id, fields)

    def usage(self, tenant: str | None = None) -> dict[str, dict[str, int | float]]:
        """tenant -> its counters (USAGE_COUNTERS, those it has): floats for FLOAT_USAGE_COUNTERS, else ints."""
        if tenant is not None:
            tenants = [check_tenant(tenant)]
        else:
            head, tail = redis_keys.tenant_usage_key("\0").split("\0")
            found = {_text(k) for k in self.client.scan_iter(match=redis_keys.tenant_usage_key("*"))}
            tenants = sorted(k.removeprefix(head).removesuffix(tail) for k in found)
        with self.client.pipeline(transaction=False) as pipe:
            for name in tenants:
                pipe.hgetall(redis_keys.tenant_usage_key(name))
            rows = pipe.execute()
        return {
            name: {
                counter: float(value) if counter in FLOAT_USAGE_COUNTERS else int(value)
                for counter, value in _decoded(fields).items()
            }
            for name, fields in zip(tenants, rows, strict=True)
        }


async def authenticate(client: aioredis.Redis, presented: str) -> KeyRecord | None:
    """The record of an active key; None for malformed, unknown or revoked keys. One round trip."""
    match = _KEY.fullmatch(presented)
    if match is None:
        return None
    key_id, secret = match.groups()
    fields = _decoded(await client.hgetall(redis_keys.api_key_key(key_id)))
    if not fields or not hmac.compare_digest(_secret_hash(secret), fields["secret_sha256"]):
        return None
    record = parse_record(key_id, fields)
    return None if record.revoked_at is not None else record


async def keys_configured(client: aioredis.Redis) -> bool:
    """Whether any active key exists (created and not revoked)."""
    return await client.scard(redis_keys.API_KEYS) > 0


def mark_keyed(pipe: redis.client.Pipeline) -> None:
    """Record, for good, that this deployment has keys: whatever writes a key queues this in its transaction."""
    pipe.set(redis_keys.KEYED_DEPLOYMENT, repr(time.time()), nx=True)


async def deployment_keyed(client: aioredis.Redis) -> bool:
    """Whether this deployment has ever had a key: the marker, or an active key (made before the marker was).
    An empty key set alone says nothing: the last key revoked, or a Redis restarted empty. One round trip."""
    async with client.pipeline(transaction=False) as pipe:
        pipe.exists(redis_keys.KEYED_DEPLOYMENT)
        pipe.scard(redis_keys.API_KEYS)
        marked, active = await pipe.execute()
    return bool(marked or active)
