"""The CPU kernels (kernels/csrc: decode attention and the fused per-layer operations), compiled on first use
(cached by torch) with this CPU's instruction set into one module. Where it cannot be built, torch ops serve.

The build is cached under a name of its own per source files (their place and text) and flags. With one name
for all, two checkouts or installs on a machine rewrote each other's build file and ninja rebuilt the kernels
(about a minute on two cores) each time the other had run, stalling the first request that needed them."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

log = logging.getLogger("kvserve.kernels")

_CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(
    _CSRC / name
    for name in (
        "bindings.cpp",
        "decode_attention_cpu.cpp",
        "fused_cpu.cpp",
        "prefill_attention_cpu.cpp",
        "small_gemm_cpu.cpp",
    )
)
HEADERS = tuple(
    _CSRC / name for name in ("cpu_vec.h", "dynamic_parallel.h", "panel_kernel.h", "softmax_row.h")
)  # included by the sources: part of the build's name, not compiled alone
# no fused multiply-add contraction: the fused operations then round exactly as torch's separate ones do
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
_LDFLAGS = ("-fopenmp",)


def build_name(sources: tuple[Path, ...], cflags: tuple[str, ...], ldflags: tuple[str, ...]) -> str:
    """The extension's module (and build directory) name for these source files, their text and the flags."""
    digest = hashlib.blake2b(digest_size=6)
    for source in sources:
        digest.update(str(source.resolve()).encode() + b"\0" + source.read_bytes() + b"\0")
    for part in (*cflags, "|", *ldflags):
        digest.update(part.encode() + b"\0")
    return f"kvserve_cpu_kernels_{digest.hexdigest()}"


def kernels_enabled() -> bool:
    """KVSERVE_CPU_KERNELS=0 turns the CPU kernels (and oneDNN weight packing) off."""
    return os.environ.get("KVSERVE_CPU_KERNELS", "1") != "0"


@functools.cache
def cpu_kernels():
    """The compiled module, or None where it is turned off or cannot be built."""
    if not kernels_enabled():
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(
            name=build_name(SOURCES + HEADERS, _CFLAGS, _LDFLAGS),
            sources=[str(s) for s in SOURCES],
            extra_cflags=list(_CFLAGS),
            extra_ldflags=list(_LDFLAGS),
            verbose=False,
        )
    except Exception as error:  # a missing compiler or ninja: serve with the torch path, and say so
        log.warning("CPU kernels unavailable (%s); using torch ops", error)
        return None
