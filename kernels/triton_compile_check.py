"""Compile every Triton kernel launch our wrappers make, for a CUDA architecture, on a machine without a GPU.

The interpreter checks what the kernels compute but not whether the compiler accepts them (types of loop
variables, early returns, dot shapes): this does, down to a cubin, using the ptxas bundled with triton. The
wrappers run on small CPU tensors with each kernel swapped for a recorder; each recorded launch is then
compiled with the same arguments' types and constexprs. Needs a process where TRITON_INTERPRET is unset.

    python -m kernels.triton_compile_check [--arch 90]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type

from kernels import triton_attention, triton_cache, triton_norm_rope
from kernels.triton_mode import interpreting

# module -> the names of the jit kernels it launches
KERNELS = {
    triton_attention: ("_attention_kernel", "_combine_splits_kernel"),
    triton_cache: ("_reshape_and_cache_kernel",),
    triton_norm_rope: ("_rms_norm_kernel", "_rotary_kernel"),
}


class _Recorder:
    def __init__(self, kernel, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


@contextlib.contextmanager
def recording() -> Iterator[list]:
    launches: list = []
    with contextlib.ExitStack() as stack:
        for module, names in KERNELS.items():
            stack.enter_context(mock.patch.object(module, "check_device", lambda *a: None))
            for name in names:
                recorder = _Recorder(getattr(module, name), launches)
                stack.enter_context(mock.patch.object(module, name, recorder))
        yield launches


def _attention_inputs(dtype, q_lens, seq_lens, block_size, kv_heads, group, head_dim):
    blocks = [-(-n // block_size) for n in seq_lens]
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    cache = torch.zeros(sum(blocks), block_size, kv_heads, head_dim, dtype=dtype)
    query = torch.zeros(sum(q_lens), kv_heads * group, head_dim, dtype=dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return query, cache, cache, table, torch.tensor(seq_lens, dtype=torch.int32), starts


# (dtype, head dim, query heads per KV head, block size): SmolLM2-135M's attention in every input dtype
# first, then bf16 with wider heads and other GQA ratios
SHAPES = [(dtype, 64, 3, 16) for dtype in (torch.bfloat16, torch.float32, torch.float16)]
SHAPES += [(torch.bfloat16, 128, 8, 32), (torch.bfloat16, 128, 1, 16)]


def record_launches(shapes: list[tuple[torch.dtype, int, int, int]]) -> list:
    """The launches the wrappers make for these shapes: decodes whole and split, a mixed batch, and the
    cache write, norms and rotary alongside."""
    with recording() as launches:
        for dtype, head_dim, group, block_size in shapes:
            decode = _attention_inputs(dtype, [1, 1], [40, 900], block_size, 2, group, head_dim)
            mixed = _attention_inputs(dtype, [1, 30], [40, 60], block_size, 2, group, head_dim)
            for args, splits in ((decode, 1), (decode, 4), (mixed, 1)):
                triton_attention.paged_attention(*args, scale=0.1, num_kv_splits=splits)
            key = torch.zeros(3, 2, head_dim, dtype=dtype)
            triton_cache.reshape_and_cache(key, key, decode[1], decode[2], torch.zeros(3, dtype=torch.int64))
            hidden = torch.zeros(3, 576, dtype=dtype)
            triton_norm_rope.rms_norm(hidden, torch.ones(576, dtype=dtype), 1e-5)
            triton_norm_rope.add_rms_norm(hidden, hidden, torch.ones(576, dtype=dtype), 1e-5)
            cos = torch.zeros(3, head_dim, dtype=dtype)
            triton_norm_rope.rotary_embedding(torch.zeros(3, 2 * group, head_dim, dtype=dtype), key, cos, cos)
    return launches


def _signature(kernel, args, kwargs) -> tuple[dict, dict]:
    signature, constexprs = {}, {}
    values = dict(zip(kernel.arg_names, args, strict=False)) | kwargs
    for param in kernel.params:
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
        else:
            signature[param.name] = mangle_type(value)
    return signature, constexprs


def compile_all(arch: int, shapes: list[tuple[torch.dtype, int, int, int]]) -> list[str]:
    """Compiles each distinct launch to a cubin; returns one line per compiled kernel."""
    target = GPUTarget("cuda", arch, 32)
    seen, lines = set(), []
    for kernel, args, kwargs in record_launches(shapes):
        signature, constexprs = _signature(kernel, args, kwargs)
        key = (kernel.fn.__name__, tuple(signature.items()), tuple(sorted(constexprs.items())))
        if key in seen:
            continue
        seen.add(key)
        start = time.perf_counter()
        compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=target)
        if not compiled.asm.get("cubin"):
            raise RuntimeError(f"{kernel.fn.__name__}: no cubin for sm_{arch}")
        lines.append(
            f"{kernel.fn.__name__} {constexprs} sm_{arch}: {compiled.metadata.shared} B shared, "
            f"{time.perf_counter() - start:.1f} s"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (90: H100/H200)")
    parser.add_argument("--quick", action="store_true", help="only the first shape (bf16, as served on GPUs)")
    args = parser.parse_args(argv)
    if interpreting():
        print("TRITON_INTERPRET=1 is set: unset it to compile", file=sys.stderr)
        return 2
    lines = compile_all(args.arch, SHAPES[:1] if args.quick else SHAPES)
    print("\n".join(lines))
    print(f"compiled {len(lines)} kernel variants for sm_{args.arch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
