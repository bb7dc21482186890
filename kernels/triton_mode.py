"""Whether Triton compiles for the GPU or interprets on the CPU, and how the interpreter gets chosen.

Triton decides once per process: `@triton.jit` reads TRITON_INTERPRET when it decorates a function, and the
jit helpers inside triton.language itself (tl.sum, tl.max, tl.cdiv) are decorated when triton is first
imported. So the variable must be set before anything imports triton; setting it later leaves a mix that
fails on the first reduction.
"""

from __future__ import annotations

import importlib.util
import os
import sys


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton kernels run in its interpreter (on CPU tensors) rather than compiled for CUDA."""
    if "triton" in sys.modules:
        from triton.language import standard
        from triton.runtime.interpreter import InterpretedFunction

        return isinstance(standard.sum, InterpretedFunction)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpret_on_cpu_only_machines(cuda_available: bool) -> bool:
    """For tests: where no CUDA device exists, switch the interpreter on before triton is imported.

    Returns whether this process interprets. Raises if it should but triton was already imported compiled."""
    if not cuda_available and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    if not cuda_available and not interpreting():
        raise RuntimeError(
            "triton was imported before TRITON_INTERPRET=1 could be set; run with TRITON_INTERPRET=1 in the "
            "environment"
        )
    return interpreting()


def check_device(tensor, caller: str) -> None:
    """Compiled Triton cannot touch CPU memory; say so instead of failing inside the launcher."""
    if tensor.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"{caller}: Triton kernels need CUDA tensors; on {tensor.device.type} they run only in Triton's "
            "interpreter (TRITON_INTERPRET=1, set before triton is imported)"
        )
