"""`kvserve keys create|update|list|revoke|usage|export|import`: tenants' API keys and what they used, straight from
Redis; export and import (gateway/tenants/key_backup.py) back them up as JSON lines, secrets only hashed. Which
Redis (--redis-url, else `kvserve up`'s store) is kvserve/keys_cli.py's to say."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence

import redis

from gateway.tenants.api_keys import (
    ADAPTER_USAGE,
    ADAPTER_USAGE_COUNTERS,
    FLOAT_USAGE_COUNTERS,
    UNCHANGED,
    USAGE_COUNTERS,
    KeyRecord,
    KeyStore,
    key_id_of,
    parse_adapters,
    parse_models,
)
from gateway.tenants.key_backup import export_lines, import_lines, write_private
from shared.redis_url import describe_error


def add_keys_args(keys: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every action's parser, each with --redis-url; the caller adds the rest and the handler."""
    actions = keys.add_subparsers(dest="action", required=True, metavar="ACTION")

    create = actions.add_parser("create", help="create a key for a tenant and print it (shown only once)")
    create.add_argument("--tenant", required=True, help="1-64 of A-Z a-z 0-9 _ . -")
    create.add_argument("--rpm", type=int, default=None, help="requests per minute (default: unlimited)")
    create.add_argument("--tpm", type=int, default=None, help="prompt + completion tokens per minute")
    create.add_argument("--max-concurrency", type=int, default=None, help="requests running at once")
    create.add_argument("--models", default=None, help="comma-separated model names (default: every model)")
    create.add_argument(
        "--weight",
        type=float,
        default=1.0,
        help="the tenant's share of each engine step and of the KV cache relative to other tenants' (default: 1)",
    )
    _add_access_args(create)
    create.set_defaults(run=create_key)

    update = actions.add_parser(
        "update", help="change what a key may use (--models, --adapters, --operator); the rest stays as it is"
    )
    update.add_argument("key", metavar="KEY_ID_OR_KEY")
    update.add_argument("--models", default=None, help='comma-separated model names ("": every model)')
    _add_access_args(update)
    update.set_defaults(run=update_key)

    listing = actions.add_parser("list", help="every key, revoked ones too, newest first")
    listing.add_argument("--tenant", default=None)
    listing.set_defaults(run=list_keys)

    revoke = actions.add_parser("revoke", help="revoke a key: its requests are refused from now on")
    revoke.add_argument("key", metavar="KEY_ID_OR_KEY")
    revoke.set_defaults(run=revoke_key)

    usage = actions.add_parser(
        "usage",
        help="each tenant's counters: requests, tokens (cached, computed), KV block-seconds, rejections",
    )
    usage.add_argument("--tenant", default=None)
    usage.set_defaults(run=show_usage)

    export = actions.add_parser(
        "export", help="every tenant and key as JSON lines (secrets only as SHA-256; salts included)"
    )
    export.add_argument(
        "--out", default=None, metavar="FILE", help="write here (mode 0600) instead of stdout"
    )
    export.set_defaults(run=export_keys)

    restore = actions.add_parser(
        "import",
        help="restore an export; idempotent, and records Redis holds otherwise stop it unless --replace",
    )
    restore.add_argument("file", metavar="FILE", help="a `kvserve keys export` (- for stdin)")
    restore.add_argument(
        "--replace",
        action="store_true",
        help="overwrite tenants and keys Redis holds otherwise with the file's (others are kept)",
    )
    restore.set_defaults(run=import_keys)

    every = [create, update, listing, revoke, usage, export, restore]
    for action in every:
        action.add_argument(
            "--redis-url",
            default=os.environ.get("KVSERVE_REDIS_URL"),
            help="default: $KVSERVE_REDIS_URL, else the store of `kvserve up` (see --data-dir)",
        )
    return every


def _add_access_args(action: argparse.ArgumentParser) -> None:
    """The LoRA flags create and update share; update leaves what is not given as it is."""
    action.add_argument(
        "--adapters",
        default=None,
        help="comma-separated LoRA adapter names the key may use beside the base model (default: none)",
    )
    action.add_argument(
        "--operator",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the key may load and unload LoRA adapters at run time (POST /v1/load_lora_adapter); default: not",
    )


def run_keys(args: argparse.Namespace, redis_url: str) -> int:
    """Connect, then run the action; bad input exits 2, Redis trouble 1, each with a message."""
    command = f"kvserve keys {args.action}"
    run: Callable[[KeyStore, argparse.Namespace], int] = args.run
    try:
        return run(KeyStore(redis.Redis.from_url(redis_url, decode_responses=True)), args)
    except ValueError as error:
        print(f"{command}: error: {error}", file=sys.stderr)
        return 2
    except redis.RedisError as error:
        print(f"{command}: error: {describe_error(redis_url, error)}", file=sys.stderr)
        return 1


def create_key(store: KeyStore, args: argparse.Namespace) -> int:
    key, record = store.create(
        args.tenant,
        args.rpm,
        args.tpm,
        args.max_concurrency,
        models=parse_models(args.models),
        weight=args.weight,
        adapters=parse_adapters(args.adapters),
        operator=bool(args.operator),
    )
    print(key, flush=True)
    print(
        f"API key {record.key_id} for tenant {record.tenant}: shown only this once, store it now",
        file=sys.stderr,
    )
    return 0


def update_key(store: KeyStore, args: argparse.Namespace) -> int:
    given = {
        "models": UNCHANGED if args.models is None else parse_models(args.models),
        "adapters": UNCHANGED if args.adapters is None else parse_adapters(args.adapters),
        "operator": UNCHANGED if args.operator is None else args.operator,
    }
    if all(value is UNCHANGED for value in given.values()):
        raise ValueError("nothing to change: give --models, --adapters or --operator/--no-operator")
    key_id = key_id_of(args.key)
    record = store.update(key_id, **given) if key_id else None
    if record is None:
        problem = (
            f"no API key with id {key_id}" if key_id else "not a key id (16 hex characters) or a kvs_ key"
        )
        print(f"kvserve keys update: error: {problem}", file=sys.stderr)  # never echo a secret back
        return 1
    _table(_HEADER, [_row(record)])
    return 0


def _table(header: Sequence[str], rows: list[Sequence[str]]) -> None:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


def _limit(value: int | None) -> str:
    return "-" if value is None else str(value)


def _row(record: KeyRecord) -> list[str]:
    return [
        record.key_id,
        record.tenant,
        _limit(record.rpm),
        _limit(record.tpm),
        _limit(record.max_concurrency),
        f"{record.weight:g}",
        ",".join(record.models) if record.models else "all",
        ",".join(record.adapters) or "-",
        "yes" if record.operator else "no",
        time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(record.created_at)),
        "active" if record.revoked_at is None else "revoked",
    ]


_HEADER = [
    "KEY ID",
    "TENANT",
    "RPM",
    "TPM",
    "MAX CONCURRENCY",
    "WEIGHT",
    "MODELS",
    "ADAPTERS",
    "OPERATOR",
    "CREATED",
    "STATUS",
]


def list_keys(store: KeyStore, args: argparse.Namespace) -> int:
    records = store.list(args.tenant)
    if not records:
        print("no API keys" + (f" for tenant {args.tenant}" if args.tenant else ""), file=sys.stderr)
        return 0
    _table(_HEADER, [_row(r) for r in records])
    return 0


def revoke_key(store: KeyStore, args: argparse.Namespace) -> int:
    key_id = key_id_of(args.key)
    record = store.revoke(key_id) if key_id else None
    if record is None:
        problem = (
            f"no API key with id {key_id}" if key_id else "not a key id (16 hex characters) or a kvs_ key"
        )
        print(f"kvserve keys revoke: error: {problem}", file=sys.stderr)  # never echo a secret back
        return 1
    print(f"revoked {record.key_id} (tenant {record.tenant})")
    return 0


def show_usage(store: KeyStore, args: argparse.Namespace) -> int:
    usage = store.usage(args.tenant)
    if not usage:
        print("no usage recorded yet", file=sys.stderr)
        return 0
    names = {name for counters in usage.values() for name in counters}
    others = sorted(name for name in names - set(USAGE_COUNTERS) if ADAPTER_USAGE not in name)
    header = ["TENANT", *(name.upper() for name in (*USAGE_COUNTERS, *others))]
    rows = [
        [tenant, *(_counter(name, counters.get(name, 0)) for name in (*USAGE_COUNTERS, *others))]
        for tenant, counters in usage.items()
    ]
    _table(header, rows)
    by_adapter = [
        [
            tenant,
            adapter,
            *(str(counters.get(f"{name}{ADAPTER_USAGE}{adapter}", 0)) for name in ADAPTER_USAGE_COUNTERS),
        ]
        for tenant, counters in usage.items()
        for adapter in sorted(
            {name.partition(ADAPTER_USAGE)[2] for name in counters if ADAPTER_USAGE in name}
        )
    ]
    if by_adapter:  # the same requests again, by the LoRA adapter they ran under
        print()
        _table(["TENANT", "ADAPTER", *(name.upper() for name in ADAPTER_USAGE_COUNTERS)], by_adapter)
    return 0


def _counter(name: str, value: float) -> str:
    return f"{value:.3f}" if name in FLOAT_USAGE_COUNTERS else str(value)


def export_keys(store: KeyStore, args: argparse.Namespace) -> int:
    lines = list(export_lines(store.client))  # read all before writing: a Redis error leaves no half file
    text = "".join(f"{line}\n" for line in lines)
    if args.out is None:
        sys.stdout.write(text)
    else:
        try:  # the salts are secrets: the file is the owner's only, from its first byte
            write_private(args.out, text)
        except (OSError, ValueError) as error:
            raise ValueError(f"--out: {error}") from None
    print(f"exported {len(lines) - 1} tenant and key records", file=sys.stderr)
    return 0


def import_keys(store: KeyStore, args: argparse.Namespace) -> int:
    try:
        if args.file == "-":
            lines = sys.stdin.read().splitlines()
        else:
            with open(args.file, encoding="utf-8") as source:
                lines = source.read().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{args.file}: {error}") from None
    try:
        result = import_lines(store.client, lines, replace=args.replace)
    except ValueError as error:
        raise ValueError(f"{args.file}: {error}") from None
    for label in result.written:
        print(f"imported {label}")
    print(f"{len(result.written)} records written, {result.unchanged} already there", file=sys.stderr)
    return 0
