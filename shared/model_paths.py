"""Where `kvserve model pull` keeps a model: the paths only, so a process without torch can find them."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from shared.defaults import DEFAULT_MODEL


def cache_dir() -> Path:
    """$KVSERVE_CACHE_DIR, else the XDG cache folder, so users and CI can move the large files."""
    if explicit := os.environ.get("KVSERVE_CACHE_DIR"):
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kvserve"


def default_model_dir() -> Path:
    """The directory the default model is converted into."""
    return cache_dir() / "models" / DEFAULT_MODEL


def gguf_model_dir(gguf_path: Path) -> Path:
    """The directory a .gguf file is converted into; a changed file (size or mtime) gets a new one."""
    stat = gguf_path.stat()
    identity = f"{gguf_path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return cache_dir() / "models" / f"gguf-{key}"
