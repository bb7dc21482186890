"""The C++ decode-attention kernel for CPUs, compiled on first use (cached by torch) with this CPU's
instruction set. Where it cannot be built, the batched-torch path serves instead.

The build is cached under a name of its own per source file (its place and its text) and flags. With one name
for all, two checkouts or installs on a machine rewrote each other's build file and ninja rebuilt the kernel
(about a minute on two cores) each time the other had run, stalling the first request that needed it."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

log = logging.getLogger("kvserve.kernels")

_SOURCE = Path(__file__).parent / "csrc" / "decode_attention_cpu.cpp"
_CFLAGS = ("-O3", "-march=native", "-fopenmp")
_LDFLAGS = ("-fopenmp",)


def build_name(source: Path, cflags: tuple[str, ...], ldflags: tuple[str, ...]) -> str:
    """The extension's module (and build directory) name for this source file, its text and the flags."""
    digest = hashlib.blake2b(digest_size=6)
    for part in (str(source.resolve()), source.read_text(), *cflags, "|", *ldflags):
        digest.update(part.encode() + b"\0")
    return f"kvserve_decode_attention_cpu_{digest.hexdigest()}"


@functools.cache
def decode_extension():
    """The compiled module, or None (KVSERVE_CPU_KERNELS=0 turns it off)."""
    if os.environ.get("KVSERVE_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(
            name=build_name(_SOURCE, _CFLAGS, _LDFLAGS),
            sources=[str(_SOURCE)],
            extra_cflags=list(_CFLAGS),
            extra_ldflags=list(_LDFLAGS),
            verbose=False,
        )
    except Exception as error:  # a missing compiler or ninja: serve with the torch path, and say so
        log.warning("CPU decode-attention kernel unavailable (%s); using the torch path", error)
        return None
