"""Whether Triton compiles for the GPU or interprets on the CPU.

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


def check_device(tensor, caller: str) -> None:
    """Compiled Triton cannot touch CPU memory; say so instead of failing inside the launcher."""
    if tensor.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"{caller}: Triton kernels need CUDA tensors; on {tensor.device.type} they run only in Triton's "
            "interpreter (TRITON_INTERPRET=1, set before triton is imported)"
        )
