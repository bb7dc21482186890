"""A `kvserve up` with one API key per tenant, for benchmarks of what tenants do to each other.

It starts a Redis of its own (kvserve.redis_server), creates the keys there with `kvserve keys create`, and runs
`kvserve up --redis-url` on it, in a session of its own so a Ctrl-C at the terminal reaches only the benchmark,
which then stops everything in order. Stopping is by PID: `kvserve up` gets SIGINT (it drains, then stops its
executors), a second SIGINT, then SIGKILL; whatever it had started and left running (found by parent PID before
it was signalled, and recognised afterwards by PID and start time) gets SIGTERM, then SIGKILL."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvserve.redis_server import EmbeddedRedis, free_port, start_redis_server

READY_TIMEOUT_S = 600.0
DRAIN_WAIT_S = 30.0  # kvserve up runs with --shutdown-grace-period 2: this is for a gateway stuck at 100% CPU
KILL_WAIT_S = 10.0


@dataclass(slots=True)
class TenantStack:
    url: str
    metrics_url: str
    keys: dict[str, str]  # tenant -> API key
    log_path: Path | None


def create_key(redis_url: str, tenant: str, key_args: Sequence[str] = ()) -> str:
    """A key made as a user makes one: `kvserve keys create` (with key_args, e.g. `--adapters a,b`), which prints
    it on stdout."""
    argv = [
        sys.executable,
        "-m",
        "kvserve.cli",
        "keys",
        "create",
        "--tenant",
        tenant,
        "--redis-url",
        redis_url,
    ]
    done = subprocess.run(
        [*argv, *key_args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if done.returncode != 0 or not done.stdout.strip():
        raise RuntimeError(f"kvserve keys create --tenant {tenant}: {done.stderr.strip()}")
    return done.stdout.strip().splitlines()[0]


def up_argv(
    redis_url: str, port: int, metrics_port: int, model: str | None, extra: Sequence[str]
) -> list[str]:
    """One CPU executor in float32: the configuration issue 27's figures were taken on."""
    argv = [sys.executable, "-m", "kvserve.cli", "up", "--redis-url", redis_url, "--executors", "1"]
    argv += [
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        "--device",
        "cpu",
        "--dtype",
        "float32",
    ]
    argv += ["--shutdown-grace-period", "2", "--log-format", "text"]
    if model is not None:
        argv += ["--model", model]
    return argv + list(extra)


@contextlib.contextmanager
def tenant_stack(
    tenants: Sequence[str],
    log_path: Path,
    model: str | None = None,
    extra_args: Sequence[str] = (),
    redis_url: str | None = None,
    key_args: Sequence[str] = (),
) -> Iterator[TenantStack]:
    """The running stack, stopped (with its Redis) however the block ends. Given redis_url, it runs on that
    Redis instead and leaves it running: a stack started again on it finds its tenants' cache salts there.
    key_args go to every tenant's `kvserve keys create`."""
    redis_server: EmbeddedRedis | None = None
    up: subprocess.Popen | None = None
    try:
        if redis_url is None:
            redis_server = start_redis_server()
            redis_url = redis_server.url
        keys = {tenant: create_key(redis_url, tenant, key_args) for tenant in tenants}
        port, metrics_port = free_port(), free_port()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log:
            argv = up_argv(redis_url, port, metrics_port, model, extra_args)
            up = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, up, log_path)
        yield TenantStack(url, f"http://127.0.0.1:{metrics_port}/metrics", keys, log_path)
    finally:
        interrupt = signal.signal(
            signal.SIGINT, signal.SIG_IGN
        )  # a second Ctrl-C must not cut the stopping short
        try:
            if up is not None:
                stop_process_tree(up)
            if redis_server is not None:
                redis_server.stop()
        finally:
            signal.signal(signal.SIGINT, interrupt)


def _wait_ready(url: str, up: subprocess.Popen, log_path: Path) -> None:
    """Until /health answers 200 (an executor registered and answering), or raise naming the log."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if up.poll() is not None:
            raise RuntimeError(f"kvserve up exited with {up.returncode}; see {log_path}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"kvserve up not ready within {READY_TIMEOUT_S:.0f} s; see {log_path}")
        time.sleep(1)


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat: with the PID, it names one process (a PID may be reused later)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def descendants(pid: int) -> list[tuple[int, str]]:
    """(PID, start time) of every process below pid, children first."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                parents.setdefault(ppid, []).append(int(entry.name))
    found, queue = [], list(parents.get(pid, []))
    while queue:
        child = queue.pop(0)
        start = _start_time(child)
        if start is not None:
            found.append((child, start))
        queue += parents.get(child, [])
    return found


def stop_process_tree(up: subprocess.Popen) -> None:
    """Stop `up` as Ctrl-C would, harder if it does not end, then anything of its tree still running."""
    tree = descendants(up.pid)
    for sig, wait_s in (
        (signal.SIGINT, DRAIN_WAIT_S),
        (signal.SIGINT, KILL_WAIT_S),
        (signal.SIGKILL, KILL_WAIT_S),
    ):
        if up.poll() is not None:
            break
        up.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            up.wait(wait_s)
    left = [(pid, start) for pid, start in tree if _start_time(pid) == start]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, start in left:
            if _start_time(pid) == start:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        deadline = time.monotonic() + KILL_WAIT_S
        while time.monotonic() < deadline and any(_start_time(pid) == start for pid, start in left):
            time.sleep(0.2)
