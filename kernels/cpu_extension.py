"""The C++ decode-attention kernel for CPUs, compiled on first use (cached by torch) with this CPU's
instruction set. Where it cannot be built, the batched-torch path serves instead."""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

log = logging.getLogger("kvserve.kernels")

_SOURCE = Path(__file__).parent / "csrc" / "decode_attention_cpu.cpp"


@functools.cache
def decode_extension():
    """The compiled module, or None (KVSERVE_CPU_KERNELS=0 turns it off)."""
    if os.environ.get("KVSERVE_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(
            name="kvserve_decode_attention_cpu",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as error:  # a missing compiler or ninja: serve with the torch path, and say so
        log.warning("CPU decode-attention kernel unavailable (%s); using the torch path", error)
        return None
