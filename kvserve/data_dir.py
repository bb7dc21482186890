"""Where `kvserve up` keeps its embedded Redis's data, and the files in it.

The folder is, in this order: `--data-dir`, `$KVSERVE_HOME`, `$XDG_DATA_HOME/kvserve`, `~/.local/share/kvserve`.
It is this user's alone (mode 0700; kvserve refuses one that others may enter) and holds:

    redis/            valkey-server's folder: the append-only file (API keys, usage, stored responses, ...), its log
    redis.password    the server's password, made once and kept (0600)
    redis.url         the running server's whole URL (0600), while a `kvserve up` serves from this folder
    lock              locked (flock) by whoever runs a server on this folder, and by that server; holds the PID of
                      the `kvserve` command that started it
    run/              each `kvserve up`'s runtime folder, unless $XDG_RUNTIME_DIR is set (kvserve/runtime_dir.py)
"""

from __future__ import annotations

import argparse
import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gateway.tenants.key_backup import write_private

PRIVATE_DIR = 0o700
BOTH_GIVEN = (
    "--data-dir is the embedded Redis's store; --redis-url (or KVSERVE_REDIS_URL) names another: give one"
)


class DataDirError(RuntimeError):
    pass


def add_data_dir_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-dir",
        default=None,
        metavar="DIR",
        help="the embedded Redis's data (default: $KVSERVE_HOME, else $XDG_DATA_HOME/kvserve, "
        "else ~/.local/share/kvserve)",
    )


def private_dir(path: Path, what: str) -> None:
    """path made (0700, its parents as the umask says) or checked: ours, and closed to other users; DataDirError
    naming `what` and path when it is not."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=PRIVATE_DIR, exist_ok=True)
        info = path.stat()
    except FileExistsError:
        raise DataDirError(f"{what} {path}: not a directory") from None
    except OSError as error:
        raise DataDirError(f"{what} {path}: {error}") from None
    if info.st_uid != os.getuid():
        raise DataDirError(f"{what} {path}: owned by another user (uid {info.st_uid})")
    if stat.S_IMODE(info.st_mode) & 0o077:
        mode = oct(stat.S_IMODE(info.st_mode))[2:]
        raise DataDirError(f"{what} {path}: mode {mode} lets other users in; `chmod 700 {path}` it")


def data_dir_path(given: str | None, environ: Mapping[str, str] = os.environ) -> Path:
    """--data-dir, else $KVSERVE_HOME, else $XDG_DATA_HOME/kvserve, else ~/.local/share/kvserve."""
    if given:
        return Path(given).expanduser()
    if environ.get("KVSERVE_HOME"):
        return Path(environ["KVSERVE_HOME"]).expanduser()
    if environ.get("XDG_DATA_HOME"):
        return Path(environ["XDG_DATA_HOME"]).expanduser() / "kvserve"
    return Path.home() / ".local" / "share" / "kvserve"


@dataclass(frozen=True, slots=True)
class DataDir:
    path: Path

    @property
    def redis_dir(self) -> Path:
        return self.path / "redis"

    @property
    def password_file(self) -> Path:
        return self.path / "redis.password"

    @property
    def url_file(self) -> Path:
        return self.path / "redis.url"

    @property
    def lock_file(self) -> Path:
        return self.path / "lock"

    def password(self) -> str:
        """The server's password: read, or made on first use. Only a holder of the lock makes it."""
        try:
            return self.password_file.read_text().strip()
        except FileNotFoundError:
            pass
        password = secrets.token_urlsafe(24)
        write_private(str(self.password_file), password + "\n")  # 0600
        return password


def open_data_dir(path: Path) -> DataDir:
    """The folder made (0700, its parents as the umask says) or checked: ours, and closed to other users (its
    Redis data holds every tenant's key hashes and cache salts)."""
    private_dir(path, "data directory")
    data = DataDir(path)
    data.redis_dir.mkdir(mode=PRIVATE_DIR, exist_ok=True)
    return data
