"""What a GPU session runs on, as JSON: the device (nvidia-smi), the versions of Python, torch, triton and
transformers, and whether each module the later stages import imports, with the traceback where one does not:
a package missing from the GPU machine's image shows here in seconds, not as a later stage's failure.

python -m bench.gpu.env [--out env.json]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import platform
import subprocess
import sys
import traceback
from pathlib import Path

# the first stage of session.sh imports what the later ones will: the engine, the kernels, the bench modules,
# pytest and its per-test timeout
MODULES = (
    "torch",
    "triton",
    "transformers",
    "safetensors",
    "executor.llm",
    "executor.engine",
    "executor.cuda_graphs",
    "executor.kv.sizing",
    "kvkernels.triton_attention",
    "kvkernels.triton_cache",
    "kvkernels.triton_norm_rope",
    "kvkernels.triton_lora",
    "kvkernels.torch_paged",
    "kvkernels.torch_twins",
    "bench.gpu.model",
    "bench.gpu.check",
    "bench.gpu.e2e",
    "bench.lora.adapters",
    "bench.gpu.kv_tiers",
    "bench.gpu.report",
    "pytest",
    "pytest_timeout",
)
PACKAGES = ("torch", "triton", "transformers", "pytest-timeout")


def nvidia_smi() -> str:
    query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
    try:
        done = subprocess.run(query, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"nvidia-smi: {error}"
    return (done.stdout or done.stderr).strip()


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for package in PACKAGES:
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


def import_failures(modules: tuple[str, ...] = MODULES) -> dict[str, str]:
    """module -> the traceback of its import, for each that does not import."""
    failures = {}
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception:  # a module that raises anything at import would fail its stage the same way
            failures[module] = traceback.format_exc()
    return failures


def cuda() -> dict:
    """What torch sees, where torch imports."""
    try:
        import torch
    except Exception as error:
        return {"error": repr(error)}
    available = torch.cuda.is_available()
    return {
        "available": available,
        "device": torch.cuda.get_device_name() if available else None,
        "torch_cuda": torch.version.cuda,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    failures = import_failures()
    report = {
        "nvidia_smi": nvidia_smi(),
        "versions": versions(),
        "cuda": cuda(),
        "imports_checked": list(MODULES),
        "import_failures": failures,
    }
    text = json.dumps(report, indent=2)
    print(text)
    for module, trace in failures.items():
        print(f"error: {module} does not import:\n{trace}", file=sys.stderr)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
