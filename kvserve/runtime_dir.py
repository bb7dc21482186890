"""Where `kvserve up` keeps what lives only as long as one run (the CURVE key pair made for it, secret keys
included): a private folder of its own, removed when the run ends, and by the next start when it could not be.

The runtime directory is `$XDG_RUNTIME_DIR/kvserve` (memory only, this user's, emptied at logout), else the data
directory's `run/` (kvserve/data_dir.py); made mode 0700, and refused when other users may enter it. Each run
makes a folder there, `<pid>-<random>` (0700), and in it `lock`, which holds its PID and which it keeps locked
(flock) while it lives. A run killed by SIGKILL, or by a power cut, leaves its folder; the next start removes every
folder whose lock is free (the kernel lets go of it when its holder dies, so a reused PID fools nobody), or that has
no lock yet and whose PID is dead. The data directory's other folders (the embedded Redis's data) are never touched.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvserve.data_dir import data_dir_path, open_data_dir, private_dir

log = logging.getLogger("kvserve.up")

LOCK = "lock"


def runtime_root(data_dir: str | None, environ: Mapping[str, str] = os.environ) -> Path:
    """$XDG_RUNTIME_DIR/kvserve, else the data directory's run/ (--data-dir, $KVSERVE_HOME, ...), made private:
    DataDirError when it, or the data directory holding it, is not this user's alone."""
    if environ.get("XDG_RUNTIME_DIR"):
        root = Path(environ["XDG_RUNTIME_DIR"]) / "kvserve"
    else:
        root = open_data_dir(data_dir_path(data_dir, environ)).path / "run"
    private_dir(root, "runtime directory")
    return root


@dataclass(slots=True)
class RunDir:
    """This run's folder, and its held lock."""

    path: Path
    fd: int

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self.fd)


def open_run_dir(root: Path) -> RunDir:
    """This run's private folder under root (runtime_root), once the folders of dead runs are gone."""
    for stale in _dead_runs(root):
        log.info("removing %s, left by a run that is gone (killed?)", stale)
        shutil.rmtree(stale, ignore_errors=True)
    path = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=root))  # mode 0700
    # locked before it takes its name: another start never sees a lock file that nobody holds yet
    fd = os.open(path / f"{LOCK}.new", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, f"{os.getpid()}\n".encode())
    os.rename(path / f"{LOCK}.new", path / LOCK)
    return RunDir(path, fd)


def _dead_runs(root: Path) -> list[Path]:
    return [path for path in root.iterdir() if path.is_dir() and not path.is_symlink() and not _alive(path)]


def _alive(run: Path) -> bool:
    """Whether the run that made this folder lives: it holds its lock; before it made one, its PID lives."""
    try:
        fd = os.open(run / LOCK, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return _pid_alive(run.name.partition("-")[0])
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    finally:
        os.close(fd)
    return False


def _pid_alive(text: str) -> bool:
    if not text.isdigit():
        return True  # not a run's folder: not ours to remove
    try:
        os.kill(int(text), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
