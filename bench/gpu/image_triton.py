"""The GPU image's Triton, installed beside the venv so that the compile check runs against it too.

bench.gpu.triton_compile_check compiles every kernel launch for sm_90 on a machine without a GPU, with the Triton
it imports. The venv's Triton is newer than the image's (bench/gpu/image.py's IMAGE_VERSIONS), and a kernel
one compiler accepts another may reject, so the image's version lives in .cache/ (ignored by git; `make test`
installs it) and the check runs a second time with that directory first on PYTHONPATH. torch stays the venv's:
Triton depends on nothing, and torch imports it only when it compiles something itself.

    python -m bench.gpu.image_triton              # installs it unless already there
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from bench.gpu.image import IMAGE_VERSIONS

VERSION = IMAGE_VERSIONS["triton"]
DIRECTORY = Path(__file__).resolve().parents[2] / ".cache" / f"triton-{VERSION}"
INSTALL_COMMAND = "make image-triton"  # what a test tells whoever lacks it


def installed() -> bool:
    return (DIRECTORY / f"triton-{VERSION}.dist-info").is_dir()


def install() -> Path:
    """pip installs into a scratch directory renamed at the end: an interrupted install leaves nothing that
    looks complete."""
    if not installed():
        partial = DIRECTORY.with_name(DIRECTORY.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(partial)]
        subprocess.run([*pip, f"triton=={VERSION}"], check=True)
        partial.rename(DIRECTORY)
    return DIRECTORY


def environ() -> dict[str, str]:
    """This process's environment with the image's Triton imported ahead of the venv's, compiling rather than
    interpreting."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(DIRECTORY), env.get("PYTHONPATH")) if p)
    return env


if __name__ == "__main__":
    print(install())
