"""The persistent embedded store: one Redis server at a time on a data directory (kvserve/data_dir.py), and how
`kvserve keys` reaches it.

Whoever runs a server on the folder holds an exclusive flock on its `lock` file: `kvserve up` for its whole run,
or a `kvserve keys` that found no server running and starts one for the command's length. The server inherits
the locked descriptor, so the lock is held until both have exited, however they end: the kernel releases it
when the last holder dies, SIGKILL included, and no stale file can make the folder look busy or free. While it
is held, `redis.url` (0600) names the server if `kvserve up` runs it; its owner removes a stale one before
starting a server, and removes its own when it stops.

`kvserve keys` without --redis-url takes the lock if it is free (no server: it starts one on the folder, runs,
stops it), else connects to the server `redis.url` names. A second `kvserve up` on the folder finds it held and
stops with a message naming the first; neither can start a second server on the same append-only file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import redis

from gateway.tenants.key_backup import write_private
from kvserve.data_dir import DataDir
from kvserve.redis_server import EmbeddedRedis, start_redis_server

HOST = "127.0.0.1"
# how long to wait for a folder another process holds: a `kvserve keys` holds it about a second; a `kvserve up`
# that is starting has published its server within a second or two of taking it
CLAIM_WAIT_S = 15.0
REACH_WAIT_S = 30.0


class StoreBusy(RuntimeError):
    pass


@dataclass(slots=True)
class Claim:
    """This process's exclusive hold on a data directory: only its holder starts a server on it."""

    data: DataDir
    fd: int
    published: bool = False

    def start_server(self) -> EmbeddedRedis:
        """The folder's server (its password, its append-only file), holding the lock with this process. Ctrl-C
        at a terminal does not reach it (its starter stops it after what uses it), and it dies with its starter
        however that ends."""
        return start_redis_server(
            HOST,
            persistent=True,
            own_process_group=True,
            dies_with_parent=True,
            password=self.data.password(),
            data_dir=self.data.redis_dir,
            pass_fds=(self.fd,),
        )

    def publish(self, url: str) -> None:
        """Name the running server for `kvserve keys` (and a person: the URL with its password)."""
        write_private(str(self.data.url_file), url + "\n")
        self.published = True

    def unpublish(self) -> None:
        """Before its server stops: `kvserve keys` then waits for the lock instead of reaching a stopping server."""
        if self.published:
            with contextlib.suppress(FileNotFoundError):
                self.data.url_file.unlink()
            self.published = False

    def release(self) -> None:
        """After its server has stopped: the lock goes (the kernel's, once the server's copy is closed too)."""
        self.unpublish()
        os.close(self.fd)


def try_claim(data: DataDir) -> Claim | None:
    """The folder's lock if no other process holds it, with this PID in the file; None if one does."""
    fd = os.open(data.lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        os.close(fd)
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    # a URL file left by a run that was SIGKILLed names no server of ours: nobody may follow it now
    with contextlib.suppress(FileNotFoundError):
        data.url_file.unlink()
    return Claim(data, fd)


def claim(data: DataDir, wait_s: float = CLAIM_WAIT_S) -> Claim:
    """The folder's lock for `kvserve up`: at once if free, after a `kvserve keys` that holds it for a moment;
    StoreBusy (naming the holder) while another `kvserve up` serves from it."""
    deadline = time.monotonic() + wait_s
    while (held := try_claim(data)) is None:
        _refuse_if_served(data)
        if time.monotonic() > deadline:
            holder = _describe(_holder(data))
            raise StoreBusy(
                f"the data directory {data.path} is in use by {holder} after {wait_s:.0f} s of waiting"
            )
        time.sleep(0.1)
    return held


def check_not_served(data: DataDir) -> None:
    """StoreBusy at once if a `kvserve up` serves from the folder: said before a long model pull, not after."""
    if (held := try_claim(data)) is not None:
        held.release()
    else:
        _refuse_if_served(data)


def _refuse_if_served(data: DataDir) -> None:
    """Called while another process holds the lock: StoreBusy if that is a `kvserve up` that has published
    its server (a `kvserve keys` publishes none)."""
    holder = _holder(data)
    if holder is not None and running_url(data) is not None:
        raise StoreBusy(
            f"another kvserve up (pid {holder}) serves from the data directory {data.path}: stop it, or give "
            "this one a --data-dir (or KVSERVE_HOME) of its own"
        )


def running_url(data: DataDir) -> str | None:
    try:
        return data.url_file.read_text().strip() or None
    except FileNotFoundError:
        return None


@contextlib.contextmanager
def reach(data: DataDir, wait_s: float = REACH_WAIT_S) -> Iterator[str]:
    """The URL of a server on the folder for one command: the running `kvserve up`'s, or one started here on
    the same data for the command's length (stopped after, its writes on disk)."""
    deadline = time.monotonic() + wait_s
    while True:
        held = try_claim(data)
        if held is not None:
            try:
                server = held.start_server()
                try:
                    yield server.url
                finally:
                    server.stop()
            finally:
                held.release()
            return
        url = running_url(data)
        if url is not None and _answers(url):
            yield url
            return
        if time.monotonic() > deadline:
            raise StoreBusy(
                f"the data directory {data.path} is held by {_describe(_holder(data))}, and no server it names "
                f"answered within {wait_s:.0f} s"
            )
        time.sleep(0.1)


def _answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2).ping())
    except redis.RedisError:
        return False


def _holder(data: DataDir) -> int | None:
    """The PID the lock file names, while that process lives."""
    try:
        pid = int(data.lock_file.read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


def _describe(holder: int | None) -> str:
    if holder is None:
        return "a server whose kvserve command has exited (it is stopping)"
    return f"pid {holder}"
