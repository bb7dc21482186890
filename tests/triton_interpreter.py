"""Triton's interpreter for test modules on machines without CUDA (kvkernels/triton_mode.py says why it must be
chosen before anything imports triton)."""

from __future__ import annotations

import os
import sys

from kvkernels.triton_mode import interpreting


def interpret_on_cpu_only_machines(cuda_available: bool) -> bool:
    """Where no CUDA device exists, switch the interpreter on before triton is imported.

    Returns whether this process interprets. Raises if it should but triton was already imported compiled."""
    if not cuda_available and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    if not cuda_available and not interpreting():
        raise RuntimeError(
            "triton was imported before TRITON_INTERPRET=1 could be set; run with TRITON_INTERPRET=1 in the "
            "environment"
        )
    return interpreting()
