"""`kvserve up` as a child process for tests, and what /proc says of the processes it started."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.processes import REPO, eventually, free_port


def children(pid: int) -> list[int]:
    """Every child of pid, whichever of its threads started it (the supervisor's thread restarts them)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with_children = task / "children"
        if with_children.exists():
            found += [int(c) for c in with_children.read_text().split()]
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def kvserve_env() -> dict[str, str]:
    """This environment without what would point a `kvserve` command elsewhere than a test says (its runtime
    folders go to its data directory's run/, not this user's $XDG_RUNTIME_DIR)."""
    ignored = ("KVSERVE_REDIS_URL", "KVSERVE_LOG_FORMAT", "XDG_RUNTIME_DIR")
    return {k: v for k, v in os.environ.items() if k not in ignored}


def environment(pid: int) -> dict[str, str]:
    """A process's environment as it started, from /proc."""
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode(errors="replace").partition("=")[::2] for e in entries if e)


class Up:
    """`kvserve up` on a tiny model as a child process, logging (as text, unless log_format says otherwise: None
    is the default, auto) to a file. Its data directory (KVSERVE_HOME) is data_dir, else a folder of its own
    beside the log: never the user's. env adds to its environment."""

    def __init__(
        self,
        model: str,
        log_path: Path,
        *extra: str,
        executors: int = 2,
        data_dir: Path | None = None,
        log_format: str | None = "text",
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.data_dir = data_dir or log_path.with_name(f"{log_path.stem}-data")
        args = [sys.executable, "-m", "kvserve.cli", "up", "--model", model, "--executors", str(executors)]
        args += ["--port", str(self.port), "--kv-cache-memory", "8MiB", "--served-model-name", "tiny"]
        args += [] if log_format is None else ["--log-format", log_format]
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [*args, *extra],
            cwd=REPO,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**kvserve_env(), "KVSERVE_HOME": str(self.data_dir), **(env or {})},
        )
        self.seen: set[int] = set()  # every child ever seen, to check none is left behind

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def children(self) -> list[int]:
        found = children(self.process.pid)
        self.seen.update(found)
        return found

    def child(self, needle: str) -> int | None:
        """The live child whose command line holds needle: "valkey-server", "--executor-id executor-1"."""
        return next((p for p in self.children() if needle in command_line(p) and alive(p)), None)

    def executors(self) -> list[str] | None:
        try:
            return httpx.get(f"{self.base}/health", timeout=10).json().get("executors")
        except (httpx.HTTPError, ValueError):
            return None

    def wait_serving(self, executors: int, timeout: float = 240) -> None:
        if not eventually(lambda: len(self.executors() or []) == executors, timeout=timeout):
            raise AssertionError(f"not serving {executors} executors in {timeout} s:\n{self.text()}")
        self.children()

    def complete(self, max_tokens: int = 3) -> httpx.Response:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": max_tokens}
        return httpx.post(f"{self.base}/v1/completions", json=body, timeout=60)

    def curve_keys(self) -> Path:
        """The folder of the key pairs made for this run, from an executor's command line."""
        return Path(
            re.search(r"--curve-keys (\S+)", command_line(self.child("--executor-id executor-0"))).group(1)
        )

    def redis_url(self) -> str:
        """The embedded Redis's URL, password included, from the file the log names (only this user can read
        it)."""
        url_file = re.search(
            r"embedded Redis at \S+ \(the whole URL, for `kvserve keys`: (\S+)\)", self.text()
        )
        return Path(url_file.group(1)).read_text().strip()

    def stop(self) -> None:
        """A failed test must not leave the stack behind: ask nicely, then stop every child by its PID."""
        self.children()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for pid in self.seen:
            if alive(pid) and command_line(pid):
                os.kill(pid, signal.SIGKILL)
        self.log.close()

    def none_left(self) -> bool:
        return not any(alive(pid) for pid in self.seen)


def reaped(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()
