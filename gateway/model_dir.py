"""The directory holding a model's tokenizer files, found without torch: the gateway reads only the tokenizer.

A directory is used as is; the default name and a .gguf file mean the directory `kvserve model pull` converts
them into, and if it does not exist yet the gateway runs that command (which needs the executor's install).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from shared.defaults import DEFAULT_MODEL
from shared.model_paths import default_model_dir, gguf_model_dir


class ModelDirError(ValueError):
    """A --model the gateway cannot find tokenizer files for; the message names the path or the command."""


def pull_command(name: str) -> list[str]:
    """The child that converts a model into the cache and prints its directory (needs torch, the gateway not)."""
    return [sys.executable, "-m", "executor.cli", "model", "pull", name]


def tokenizer_dir(model: str | None) -> Path:
    if model is None or model == DEFAULT_MODEL:
        return _pulled(DEFAULT_MODEL, default_model_dir())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _pulled(model, gguf_model_dir(path))
    if path.is_dir():
        return path
    raise ModelDirError(f"model {model!r}: expected {DEFAULT_MODEL!r}, a .gguf file or a model directory")


def _pulled(name: str, converted: Path) -> Path:
    """The converted directory, running `kvserve model pull` first when it is not there yet."""
    if converted.is_dir():
        return converted
    done = subprocess.run(pull_command(name), capture_output=True, text=True)
    printed = done.stdout.strip().splitlines()
    if done.returncode != 0 or not printed or not Path(printed[-1]).is_dir():
        detail = "\n".join(
            (done.stderr.strip() or done.stdout.strip()).splitlines()[-10:]
        )  # its error, not a log
        raise ModelDirError(
            f"{converted} does not exist and `kvserve model pull {name}` failed ({done.returncode}); "
            f"run it where the executor is installed (it needs torch):\n{detail}"
        )
    return Path(printed[-1])
