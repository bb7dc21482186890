"""Where a model's directory is, from its name, without reading it: the engine converts and loads what lies there
(executor/models/model_files.py), the gateway reads only its tokenizer, and neither needs torch to find it."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from shared.child_env import engine_environment
from shared.defaults import DEFAULT_MODEL
from shared.parent_death import dying_with_this_process

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
# a converted GGUF's quantized weights as they are (executor/models/gguf_quantized.py), in a subfolder: HF loaders
# and the *.safetensors of a model directory leave it alone
GGUF_BLOCKS = Path("gguf-blocks") / "weights.safetensors"


class ModelLoadError(ValueError):
    """A model that cannot be found, fetched or converted; the message names the file or the feature."""


def cache_dir() -> Path:
    """$KVSERVE_CACHE_DIR, else the XDG cache folder, so users and CI can move the large files."""
    if explicit := os.environ.get("KVSERVE_CACHE_DIR"):
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kvserve"


def is_default(model: str | None) -> bool:
    return model is None or model == DEFAULT_MODEL


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL


def is_gguf(model: str) -> bool:
    path = Path(model).expanduser()
    return path.is_file() and path.suffix == ".gguf"


def gguf_model_dir(gguf_path: Path) -> Path:
    """Where a .gguf file's conversion goes: named by the file's path, size and mtime, so a changed file converts
    anew."""
    stat = gguf_path.stat()
    identity = f"{gguf_path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return cache_dir() / "models" / f"gguf-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"


def model_dir(model: str | None) -> Path:
    """The directory `model` (the default name, a .gguf file or a model directory) is served from; the first two
    exist only once pulled. What a directory must hold, check_model_dir says."""
    if is_default(model):
        return default_model_dir()
    if is_gguf(model):
        return gguf_model_dir(Path(model).expanduser())
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    raise ModelLoadError(f"model {model!r}: expected {DEFAULT_MODEL!r}, a .gguf file or a model directory")


def pull_command(model: str | None) -> list[str]:
    """`kvserve model pull`: fetches and converts into the cache, prints the directory (needs the executor's
    install, torch included)."""
    return [sys.executable, "-m", "kvserve.cli", "model", "pull", *([] if model is None else [model])]


def pulled_model_dir(model: str | None) -> Path:
    """`model_dir`, pulled first by a `kvserve model pull` child when it is not there yet: for processes that
    must not load torch themselves (the gateway, `kvserve up`)."""
    path = model_dir(model)
    if path.is_dir():
        return path
    # it dies with this process: a pull is long, and nobody would be left to read what it prints; it gets what
    # a download and a conversion read, not this process's secrets (a Redis URL)
    command = dying_with_this_process(pull_command(model))
    done = subprocess.run(command, capture_output=True, text=True, env=engine_environment())
    printed = done.stdout.strip().splitlines()
    if done.returncode != 0 or not printed or not Path(printed[-1]).is_dir():
        error = (done.stderr.strip() or done.stdout.strip()).splitlines()[-10:]  # its error, not its log
        name = "" if model is None else f" {model}"
        raise ModelLoadError(
            f"{path} does not exist and `kvserve model pull{name}` failed ({done.returncode}); run it where "
            "the executor is installed (it needs torch):\n" + "\n".join(error)
        )
    return Path(printed[-1])


def check_model_dir(path: Path) -> None:
    """Fail at startup naming the missing file, not later inside transformers."""
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path / 'config.json'} is missing: {path} is not a model directory")
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"{path} has no *.safetensors weights")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"{path} has no tokenizer (expected {' or '.join(TOKENIZER_FILES)})")
