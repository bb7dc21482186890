"""`kvserve up`'s runtime folders: private, one per run, and those of runs that are gone (SIGKILL) removed by the next
start, while live runs' folders and the data directory's Redis data stay."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys

import pytest

from kvserve.data_dir import DataDirError
from kvserve.runtime_dir import LOCK, open_run_dir, runtime_root
from tests.processes import REPO

HOLD = """
import sys, time
from pathlib import Path
from kvserve.runtime_dir import open_run_dir
run = open_run_dir(Path(sys.argv[1]))
(run.path / "secret").write_text("a run's secret")
print(run.path, flush=True)
time.sleep(600)
"""


def _run_elsewhere(root) -> tuple[subprocess.Popen, str]:
    """Another process holding a run folder under root; (it, its folder)."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(root)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    return process, process.stdout.readline().strip()


def test_a_killed_runs_folder_goes_at_the_next_start_and_a_live_ones_stays(tmp_path):
    root = runtime_root(str(tmp_path / "data"), {})
    assert root == tmp_path / "data" / "run"
    (tmp_path / "data" / "redis" / "appendonly.aof").write_text("the store's data")
    killed, killed_dir = _run_elsewhere(root)
    live, live_dir = _run_elsewhere(root)
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert os.path.exists(f"{killed_dir}/secret")  # nobody cleaned up after it
        (root / f"{killed.pid}-nolock").mkdir()  # killed before it made its lock: its PID is dead
        (root / "not-a-run").mkdir()

        run = open_run_dir(root)
        try:
            assert not os.path.exists(killed_dir) and not (root / f"{killed.pid}-nolock").exists()
            assert os.path.exists(f"{live_dir}/secret") and (root / "not-a-run").exists()
            assert stat.S_IMODE(run.path.stat().st_mode) == 0o700 and run.path.parent == root
            assert (run.path / LOCK).read_text() == f"{os.getpid()}\n"
            assert (tmp_path / "data" / "redis" / "appendonly.aof").read_text() == "the store's data"
        finally:
            run.remove()
        assert not run.path.exists()
    finally:
        live.kill()
        live.wait()


def test_the_runtime_root_is_xdg_runtime_dir_when_set_and_private(tmp_path):
    xdg = tmp_path / "xdg"
    xdg.mkdir()
    assert runtime_root(None, {"XDG_RUNTIME_DIR": str(xdg)}) == xdg / "kvserve"
    assert stat.S_IMODE((xdg / "kvserve").stat().st_mode) == 0o700
    (xdg / "kvserve").chmod(0o755)
    with pytest.raises(DataDirError, match="runtime directory .* lets other users in"):
        runtime_root(None, {"XDG_RUNTIME_DIR": str(xdg)})
