"""The CPU kernels (kvkernels/csrc: decode attention and the fused per-layer operations), compiled on first use
(cached by torch) with this CPU's instruction set into one module. Where it cannot be built, torch ops serve.

The build is cached under a name of its own per source files (their place and text) and flags, so two checkouts
on one machine never rebuild each other's kernels (about a minute on two cores, stalling the first request).

Builds of one name take turns under an flock of their own, not torch's lock file alone: a process killed while
building leaves that file behind and every later start would wait on it forever; the kernel releases an flock
when its holder dies, so under it a torch lock file can only be stale."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import sys
import time
from pathlib import Path

log = logging.getLogger("kvserve.kernels")

_CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(
    _CSRC / name
    for name in (
        "argmax_cpu.cpp",
        "bindings.cpp",
        "decode_attention_cpu.cpp",
        "decoder_stack_cpu.cpp",
        "decoder_stack_team.cpp",
        "fused_cpu.cpp",
        "lora_cpu.cpp",
        "prefill_attention_cpu.cpp",
        "quantized_gemm_cpu.cpp",
        "small_gemm_cpu.cpp",
    )
)
HEADERS = tuple(
    _CSRC / name
    for name in (
        "cpu_kernels.h",
        "cpu_vec.h",
        "decode_attention_cpu.h",
        "decoder_stack_cpu.h",
        "dynamic_parallel.h",
        "fused_rows.h",
        "int8_dot_kernel.h",
        "lora_cpu.h",
        "panel_kernel.h",
        "prefetch.h",
        "quantized_gemm_cpu.h",
        "region_error.h",
        "softmax_row.h",
        "stealing_parallel.h",
        "team_done_bits.h",
    )
)  # included by the sources: part of the build's name, not compiled alone
# no fused multiply-add contraction: the fused operations then round exactly as torch's separate ones do
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
_LDFLAGS = ("-fopenmp",)
BUILD_TIME = "about a minute on two cores"  # what a first start is told to expect


def build_name(sources: tuple[Path, ...], cflags: tuple[str, ...], ldflags: tuple[str, ...]) -> str:
    """The extension's module (and build directory) name for these source files, their text and the flags."""
    import torch

    digest = hashlib.blake2b(digest_size=6)
    digest.update(f"{torch.__version__} py{sys.version_info[0]}.{sys.version_info[1]}".encode() + b"\0")
    for source in sources:
        digest.update(str(source.resolve()).encode() + b"\0" + source.read_bytes() + b"\0")
    for part in (*cflags, "|", *ldflags):
        digest.update(part.encode() + b"\0")
    return f"kvserve_cpu_kernels_{digest.hexdigest()}"


def kernels_enabled() -> bool:
    """KVSERVE_CPU_KERNELS=0 turns the CPU kernels (and oneDNN weight packing) off."""
    return os.environ.get("KVSERVE_CPU_KERNELS", "1") != "0"


def build_directory(name: str) -> Path:
    """Where the build of this name lives: under $TORCH_EXTENSIONS_DIR, else torch's default root."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / name


def kernels_build_directory() -> Path:
    """The build directory of these sources with these flags."""
    return build_directory(build_name(SOURCES + HEADERS, _CFLAGS, _LDFLAGS))


@contextlib.contextmanager
def exclusive_build(directory: Path):
    """This process alone builds or loads in directory until the block ends (or the process dies)."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "kvserve-build.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a start that waits says why, or it looks hung
            log.info(
                "waiting for another process compiling the CPU kernels in %s (%s)", directory, BUILD_TIME
            )
            fcntl.flock(handle, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)  # torch's own: every builder holds ours first, so stale
        yield


@functools.cache
def cpu_kernels():
    """The compiled module, or None where it is turned off or cannot be built."""
    if not kernels_enabled():
        return None
    try:
        from torch.utils.cpp_extension import load

        directory = kernels_build_directory()
        with exclusive_build(directory):
            fresh = not (directory / f"{directory.name}.so").is_file()
            if fresh:  # otherwise the first start is a minute of silence
                log.info(
                    "compiling the CPU kernels (kvkernels/csrc) for this CPU into %s: %s, once; later starts "
                    "load that build",
                    directory,
                    BUILD_TIME,
                )
            started = time.perf_counter()
            module = load(
                name=directory.name,
                sources=[str(s) for s in SOURCES],
                extra_cflags=list(_CFLAGS),
                extra_ldflags=list(_LDFLAGS),
                build_directory=str(directory),
                verbose=False,
            )
            if fresh:
                log.info("CPU kernels compiled in %.0f s", time.perf_counter() - started)
            return module
    except Exception as error:  # a missing compiler or ninja: serve with the torch path, and say so
        log.warning("CPU kernels unavailable (%s); using torch ops", error)
        return None
