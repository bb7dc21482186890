"""`kvserve ready --executor-id ID`: exit 0 when that executor is registered in Redis, else 1. An executor
registers once its model is loaded and its socket bound, and its registration expires with its heartbeat, so
this is its readiness: Kubernetes' and compose's probes run it beside the executor (one line says why not)."""

from __future__ import annotations

import argparse
import os
import sys

import redis

from shared import redis_keys
from shared.redis_url import describe_error

PROBE_TIMEOUT_S = 2.0


def add_ready_args(ready: argparse.ArgumentParser) -> None:
    ready.add_argument(
        "--executor-id",
        default=os.environ.get("KVSERVE_EXECUTOR_ID"),
        help="the executor's --executor-id (default: $KVSERVE_EXECUTOR_ID, which a probe beside it inherits)",
    )
    ready.add_argument(
        "--redis-url", default=os.environ.get("KVSERVE_REDIS_URL"), help="default: $KVSERVE_REDIS_URL"
    )
    ready.set_defaults(handler=check_ready)


def check_ready(args: argparse.Namespace) -> int:
    if not args.executor_id:
        print(
            "kvserve ready: error: --executor-id: not given and KVSERVE_EXECUTOR_ID is not set",
            file=sys.stderr,
        )
        return 2
    if not args.redis_url:
        print(
            "kvserve ready: error: --redis-url: not given and KVSERVE_REDIS_URL is not set", file=sys.stderr
        )
        return 2
    client = redis.Redis.from_url(
        args.redis_url, socket_connect_timeout=PROBE_TIMEOUT_S, socket_timeout=PROBE_TIMEOUT_S
    )
    try:
        registered = bool(client.exists(redis_keys.executor_key(args.executor_id)))
    except redis.RedisError as error:
        print(f"kvserve ready: {describe_error(args.redis_url, error)}", file=sys.stderr)
        return 1
    finally:
        client.close()
    if not registered:
        print(f"kvserve ready: executor {args.executor_id} is not registered in Redis", file=sys.stderr)
        return 1
    return 0
