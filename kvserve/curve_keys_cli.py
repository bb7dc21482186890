"""`kvserve curve-keys`: writes the executor's and the gateway's ZeroMQ CURVE key pairs, which both sides then
load (shared/curve_keys.py)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import zmq.auth

from shared.curve_keys import EXECUTOR, GATEWAY, CurveKeyError, load_executor_keys, load_gateway_keys

SECRET_MODE = 0o600


def key_files(directory: Path) -> list[Path]:
    return [
        directory / f"{name}{suffix}" for name in (EXECUTOR, GATEWAY) for suffix in (".key", ".key_secret")
    ]


def write_keys(directory: Path, force: bool = False) -> list[Path]:
    """A fresh executor and gateway key pair in directory (made if missing); secret files mode 0600.
    Refuses to overwrite existing files unless force."""
    files = key_files(directory)
    existing = [str(f) for f in files if f.exists()]
    if existing and not force:
        raise CurveKeyError(f"{', '.join(existing)} already exist; pass --force to replace them")
    directory.mkdir(parents=True, exist_ok=True)
    old_umask = os.umask(0o077)  # the secret files never exist with wider permissions, even for a moment
    try:
        for name in (EXECUTOR, GATEWAY):
            for path in (directory / f"{name}.key", directory / f"{name}.key_secret"):
                path.unlink(missing_ok=True)
            zmq.auth.create_certificates(directory, name)
            (directory / f"{name}.key").chmod(0o644)  # public: gateways' copies may be shared freely
            (directory / f"{name}.key_secret").chmod(SECRET_MODE)
    finally:
        os.umask(old_umask)
    return files


def add_curve_keys_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, metavar="DIR", help="directory for the four key files")
    kept = parser.add_mutually_exclusive_group()
    kept.add_argument("--force", action="store_true", help="replace key files already there")
    kept.add_argument(
        "--if-missing",
        action="store_true",
        help="keep the four files when they are all there and sound (an init step that runs at every start)",
    )
    parser.set_defaults(handler=generate)


def generate(args: argparse.Namespace) -> int:
    try:
        if args.if_missing and all(f.exists() for f in key_files(Path(args.out))):
            load_executor_keys(args.out), load_gateway_keys(args.out)  # sound, or the error names the file
            print(f"kvserve curve-keys: {args.out} holds both key pairs already; kept", file=sys.stderr)
            return 0
        files = write_keys(Path(args.out), args.force)
    except (CurveKeyError, OSError) as error:
        print(f"kvserve curve-keys: error: {error}", file=sys.stderr)
        return 2
    print("\n".join(str(f) for f in files))
    print(
        "executors get executor.key_secret and gateway.key; gateways get gateway.key_secret and "
        "executor.key (--curve-keys DIR or $KVSERVE_CURVE_KEYS)",
        file=sys.stderr,
    )
    return 0
