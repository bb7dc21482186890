"""Tenants and their API keys as JSON lines, and back (`kvserve keys export|import`): a backup of what Redis
holds, to restore into the same or an empty Redis.

The first line names the format; then one line per tenant (its cache salt) and one per key (tenant, limits,
models, times and the SHA-256 of its secret: a backup lets nobody in, and restored keys authenticate as
before). Usage counters and rate-limit state are not part of it. The salt is a secret too: whoever holds the
file could compute the tenant's block hashes, so keep it like a password file: an export to a file is written
to a new file only its owner can read and renamed into place (write_private).

Import checks every line before it writes anything, and writes in one transaction. It is idempotent: a record
already in Redis as the file has it is left alone; one that differs is a conflict that stops the import,
unless `replace` is given, which overwrites the records the file names (and never deletes others).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import redis

from gateway.tenants.api_keys import (
    LIMITS,
    KeyRecord,
    check_adapters,
    check_limit,
    check_models,
    check_tenant,
    check_weight,
    key_id_of,
    mark_keyed,
    parse_record,
    record_fields,
)
from shared import redis_keys

FORMAT = "kvserve-keys"
VERSION = 1
_HEADER = {"type": "header", "format": FORMAT, "version": VERSION}
_HEX64 = re.compile(r"[0-9a-f]{64}")
_TENANT_FIELDS = {"type", "tenant", "cache_salt"}
_KEY_FIELDS = {"type", "key_id", "tenant", "secret_sha256", *LIMITS, "models", "created_at", "revoked_at"}
_OPTIONAL_KEY_FIELDS = {"weight", "adapters", "operator"}  # absent from exports made before they existed


@dataclass(slots=True)
class ImportResult:
    written: list[str]  # "tenant acme", "key 0123456789abcdef"
    unchanged: int


def export_lines(client: redis.Redis) -> Iterator[str]:
    """Every tenant and every key (revoked ones too), one JSON object a line. client: decode_responses=True."""
    yield json.dumps(_HEADER)
    prefix = redis_keys.tenant_key("")
    tenants = sorted(
        name
        for name in (k.removeprefix(prefix) for k in client.scan_iter(match=prefix + "*"))
        if ":" not in name  # kvserve:tenant:<name>:usage is the counters, not the tenant
    )
    for tenant in tenants:
        salt = client.hget(redis_keys.tenant_key(tenant), "cache_salt")
        if salt:
            yield json.dumps({"type": "tenant", "tenant": tenant, "cache_salt": salt})
    prefix = redis_keys.api_key_key("")
    for key_id in sorted(k.removeprefix(prefix) for k in client.scan_iter(match=prefix + "*")):
        fields = client.hgetall(redis_keys.api_key_key(key_id))
        if not fields:
            continue
        record = parse_record(key_id, fields)
        yield json.dumps(
            {
                "type": "key",
                "key_id": key_id,
                "tenant": record.tenant,
                "secret_sha256": fields["secret_sha256"],
                **{name: getattr(record, name) for name in LIMITS},
                "models": list(record.models) if record.models else None,
                "created_at": record.created_at,
                "revoked_at": record.revoked_at,
                "weight": record.weight,
                "adapters": list(record.adapters),
                "operator": record.operator,
            }
        )


def write_private(path: str, text: str) -> None:
    """text as the file at path, readable by its owner only, whatever file was there: written to a new 0600 file in
    the same folder and renamed over it, so no reader sees it half written and an existing file's wider mode is not
    kept. A symbolic link is refused, not followed: the export would land wherever it points."""
    if os.path.islink(path):
        raise ValueError(f"{path} is a symbolic link; name the file itself")
    directory, name = os.path.split(os.path.abspath(path))
    fd, staging = tempfile.mkstemp(prefix=f".{name}.", suffix=".partial", dir=directory)  # created 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(staging, path)  # renames over a link that appeared meanwhile, never through it
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staging)
        raise


def parse_lines(lines: Iterable[str]) -> tuple[dict[str, str], list[tuple[KeyRecord, str]]]:
    """(tenant -> cache salt, [(key record, secret sha256)]) from an export; ValueError naming the line."""
    salts: dict[str, str] = {}
    keys: dict[str, tuple[KeyRecord, str]] = {}
    seen_header = False
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            if not isinstance(item, dict):
                raise ValueError("not a JSON object")
            if not seen_header:
                if item != _HEADER:
                    raise ValueError(
                        f"the first line must be {json.dumps(_HEADER)} (a `kvserve keys export`)"
                    )
                seen_header = True
            elif item.get("type") == "tenant":
                tenant, salt = _tenant(item)
                if tenant in salts:
                    raise ValueError(f"tenant {tenant} appears twice")
                salts[tenant] = salt
            elif item.get("type") == "key":
                record, secret_sha256 = _key(item, salts)
                if record.key_id in keys:
                    raise ValueError(f"key {record.key_id} appears twice")
                keys[record.key_id] = (record, secret_sha256)
            else:
                raise ValueError(f"type: {item.get('type')!r} is not header, tenant or key")
        except ValueError as error:  # json.JSONDecodeError is one
            raise ValueError(f"line {number}: {error}") from None
    if not seen_header:
        raise ValueError("empty: not a `kvserve keys export`")
    return salts, list(keys.values())


def _fields(item: dict, required: set[str], optional: set[str] = frozenset()) -> None:
    unknown = sorted(set(item) - required - optional)
    missing = sorted(required - set(item))
    if unknown or missing:
        raise ValueError(
            "; ".join(
                part
                for part in (
                    f"unknown field(s) {', '.join(unknown)}" if unknown else "",
                    f"missing field(s) {', '.join(missing)}" if missing else "",
                )
                if part
            )
        )


def _tenant(item: dict) -> tuple[str, str]:
    _fields(item, _TENANT_FIELDS)
    tenant = check_tenant(item["tenant"])
    if not isinstance(item["cache_salt"], str) or not _HEX64.fullmatch(item["cache_salt"]):
        raise ValueError(f"tenant {tenant}: cache_salt must be 64 hex characters")
    return tenant, item["cache_salt"]


def _time(name: str, value, optional: bool) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"{name}: {value!r} must be a time in seconds since the epoch")
    return float(value)


def _flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: {value!r} must be true or false")
    return value


def _key(item: dict, salts: dict[str, str]) -> tuple[KeyRecord, str]:
    _fields(item, _KEY_FIELDS, _OPTIONAL_KEY_FIELDS)
    key_id = item["key_id"]
    if not isinstance(key_id, str) or key_id_of(key_id) != key_id:
        raise ValueError(f"key_id: {key_id!r} must be 16 hex characters")
    tenant = check_tenant(item["tenant"])
    if tenant not in salts:
        raise ValueError(f"key {key_id}: tenant {tenant} has no tenant line before it")
    secret_sha256 = item["secret_sha256"]
    if not isinstance(secret_sha256, str) or not _HEX64.fullmatch(secret_sha256):
        raise ValueError(f"key {key_id}: secret_sha256 must be 64 hex characters (a SHA-256, never a secret)")
    record = KeyRecord(
        key_id,
        tenant,
        salts[tenant],
        *(check_limit(name, item[name]) for name in LIMITS),
        models=check_models(item["models"]),
        created_at=_time("created_at", item["created_at"], optional=False),
        revoked_at=_time("revoked_at", item["revoked_at"], optional=True),
        weight=check_weight(item.get("weight", 1.0)),
        adapters=check_adapters(item.get("adapters")),
        operator=_flag("operator", item.get("operator", False)),
    )
    return record, secret_sha256


def import_lines(client: redis.Redis, lines: Iterable[str], replace: bool = False) -> ImportResult:
    """Write an export into Redis (client: decode_responses=True). Without replace, a record Redis holds
    otherwise raises ValueError naming it, and nothing is written."""
    salts, keys = parse_lines(lines)
    held_salts = {tenant: client.hget(redis_keys.tenant_key(tenant), "cache_salt") for tenant in salts}
    new_salts = {tenant: salt for tenant, salt in salts.items() if held_salts[tenant] != salt}
    wanted = {record.key_id: (record, record_fields(record, sha256)) for record, sha256 in keys}
    held = {key_id: client.hgetall(redis_keys.api_key_key(key_id)) for key_id in wanted}
    new_keys = {key_id: pair for key_id, pair in wanted.items() if held[key_id] != pair[1]}
    conflicts = [f"tenant {t}" for t in new_salts if held_salts[t] is not None]
    conflicts += [f"key {key_id}" for key_id in new_keys if held[key_id]]
    if conflicts and not replace:
        raise ValueError(
            f"Redis already holds {', '.join(conflicts)} otherwise; nothing was imported "
            "(--replace overwrites them with the file's)"
        )
    # every key record carries its tenant's salt: a tenant's keys the file does not name follow a new salt
    followers = _keys_of(
        client, set(new_salts) - {t for t, s in held_salts.items() if s is None}, set(wanted)
    )
    with client.pipeline() as pipe:  # MULTI: all of it or nothing
        for tenant, salt in new_salts.items():
            pipe.hset(redis_keys.tenant_key(tenant), "cache_salt", salt)
        for record, fields in new_keys.values():
            pipe.hset(redis_keys.api_key_key(record.key_id), mapping=fields)
        for record, _ in wanted.values():  # the active set follows each record, changed or not
            if record.revoked_at is None:
                pipe.sadd(redis_keys.API_KEYS, record.key_id)
            else:
                pipe.srem(redis_keys.API_KEYS, record.key_id)
        for key_id, tenant in followers:
            pipe.hset(redis_keys.api_key_key(key_id), "cache_salt", new_salts[tenant])
        if wanted:  # a deployment restored from a backup with keys never runs open, even if all are revoked
            mark_keyed(pipe)
        pipe.execute()
    written = [f"tenant {t}" for t in new_salts] + [f"key {key_id}" for key_id in new_keys]
    return ImportResult(written, len(salts) + len(wanted) - len(written))


def _keys_of(client: redis.Redis, tenants: set[str], skip: set[str]) -> list[tuple[str, str]]:
    """(key id, tenant) of every key in Redis of these tenants, but those in skip."""
    if not tenants:
        return []
    prefix = redis_keys.api_key_key("")
    found = []
    for key in client.scan_iter(match=prefix + "*"):
        key_id = key.removeprefix(prefix)
        tenant = client.hget(key, "tenant")
        if key_id not in skip and tenant in tenants:
            found.append((key_id, tenant))
    return found
