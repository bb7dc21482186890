"""`kvserve up`: Redis, executors and gateway from one command; Ctrl-C leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.processes import REPO, eventually, free_port


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_up_serves_and_ctrl_c_stops_everything(tiny_models, tmp_path):
    port = free_port()
    args = [sys.executable, "-m", "executor.cli", "up", "--model", tiny_models["llama"], "--executors", "2"]
    args += ["--port", str(port), "--kv-cache-memory", "8MiB", "--served-model-name", "tiny"]
    log = open(tmp_path / "up.log", "wb")  # noqa: SIM115 - closed below
    up = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:

        def serving() -> bool:
            try:
                return len(httpx.get(f"{base}/health").json().get("executors", [])) == 2
            except (httpx.HTTPError, ValueError):
                return False

        assert eventually(serving, timeout=90), (tmp_path / "up.log").read_text()
        started = children(up.pid)
        assert len(started) == 3  # Redis and two executors
        response = httpx.post(
            f"{base}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3}, timeout=60
        )
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
        up.send_signal(signal.SIGINT)
        up.wait(60)
        assert eventually(lambda: not any(alive(pid) for pid in started), timeout=10)
    finally:
        # a failed test must not leave the stack behind: ask nicely, then stop every child by its PID
        leftover = children(up.pid)
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait()
        for pid in leftover:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        log.close()
