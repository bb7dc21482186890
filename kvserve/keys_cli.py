"""`kvserve keys`: the actions are gateway/tenants/keys_cli.py's; this says which Redis they run on. --redis-url
(or $KVSERVE_REDIS_URL) names one; without it, the store of `kvserve up` in the data directory: its running server,
or, when no `kvserve up` runs there, one started on the same data for the command's length (kvserve/store.py). So
keys made before the first `kvserve up --require-api-key`, or beside a running one, are the stack's at once."""

from __future__ import annotations

import argparse
import sys

from gateway.tenants import keys_cli
from kvserve.data_dir import BOTH_GIVEN, DataDirError, add_data_dir_arg, data_dir_path, open_data_dir
from kvserve.redis_server import RedisServerError
from kvserve.store import StoreBusy, reach


def add_keys_args(keys: argparse.ArgumentParser) -> None:
    for action in keys_cli.add_keys_args(keys):
        add_data_dir_arg(action)
        action.set_defaults(handler=run_keys)


def run_keys(args: argparse.Namespace) -> int:
    command = f"kvserve keys {args.action}"
    if args.redis_url:
        if args.data_dir:
            print(f"{command}: error: {BOTH_GIVEN}", file=sys.stderr)
            return 2
        return keys_cli.run_keys(args, args.redis_url)
    try:
        with reach(open_data_dir(data_dir_path(args.data_dir))) as redis_url:
            return keys_cli.run_keys(args, redis_url)
    except (DataDirError, StoreBusy, RedisServerError) as error:
        print(f"{command}: error: {error}", file=sys.stderr)
        return 1
