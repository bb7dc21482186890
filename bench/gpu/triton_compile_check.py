"""Compile every Triton kernel launch our wrappers make, for a CUDA architecture, on a machine without a GPU.

The interpreter checks what the kernels compute but not whether the compiler accepts them (types of loop
variables, early returns, dot shapes): this does, down to a cubin, using the ptxas bundled with triton. The
wrappers run on small CPU tensors with each kernel swapped for a recorder; each recorded launch is then compiled
by the JIT's own warmup, which specialises it as a launch with those arguments would: an int argument equal to 1
becomes a constant, ints divisible by 16 and 16-byte aligned pointers are compiled as such, and vector widths and
masks follow. The launches are first those the engine makes serving SmolLM2-135M on an H200, then other shapes
and dtypes. Needs a process where TRITON_INTERPRET is unset.

    python -m bench.gpu.triton_compile_check [--arch 90] [--quick]

Against the GPU image's Triton instead of this machine's: the same with bench/gpu/image_triton.py's directory
first on PYTHONPATH (`make image-triton` installs it; tests/bench/gpu/test_triton_compile_check.py runs both).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

from kvkernels import triton_attention, triton_cache, triton_lora, triton_norm_rope
from kvkernels.triton_mode import interpreting

# module -> the names of the jit kernels it launches
KERNELS = {
    triton_attention: ("_attention_kernel", "_combine_splits_kernel"),
    triton_cache: ("_reshape_and_cache_kernel",),
    triton_lora: ("_shrink_kernel", "_expand_kernel"),
    triton_norm_rope: ("_rms_norm_kernel", "_rotary_kernel"),
}


@dataclass(slots=True)
class Launch:
    step: str  # the wrapper calls that made it, for the report
    kernel: triton.runtime.JITFunction
    args: tuple
    kwargs: dict


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


def record(steps: dict[str, Callable[[], None]]) -> list[Launch]:
    """The launches each step's wrapper calls make, labelled with the step."""
    launches = []
    with recording() as made:
        for step, run in steps.items():
            first = len(made)
            run()
            launches += [Launch(step, *launch) for launch in made[first:]]
    return launches


# SmolLM2-135M, the default model, as the engine serves it (executor/models/llama.py), on an H200
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 576, 9, 3, 64, 16
H200_SMS = 132


def _engine_layer(q_lens: list[int], table_width: int) -> None:
    """One decoder layer's Triton calls on the tensors the engine passes: q, k and v are views of one qkv GEMM's
    output, the caches one layer's slice of the whole pool, the KV splits those an H200 gets. Only shapes,
    strides and alignment matter to the compiler, never the values."""
    dtype, tokens, seqs = torch.bfloat16, sum(q_lens), len(q_lens)
    qkv = torch.zeros(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=dtype)
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    q, k, v = (x.view(tokens, -1, HEAD_DIM) for x in (q, k, v))
    cos = torch.zeros(tokens, HEAD_DIM, dtype=dtype)
    q, k = triton_norm_rope.rotary_embedding(q, k, cos, cos)
    pool = torch.zeros(2, 2, 4, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype)  # [layer, K/V, block, ...]
    key_cache, value_cache = pool[1, 0], pool[1, 1]
    triton_cache.reshape_and_cache(k, v, key_cache, value_cache, torch.zeros(tokens, dtype=torch.int64))
    table = torch.zeros(seqs, table_width, dtype=torch.int32)
    starts = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    seq_lens = torch.ones(seqs, dtype=torch.int32)
    splits = triton_attention.choose_num_splits(tokens, seqs, KV_HEADS, table_width * BLOCK_SIZE, H200_SMS)
    triton_attention.paged_attention(
        q, key_cache, value_cache, table, seq_lens, starts, HEAD_DIM**-0.5, num_kv_splits=splits
    )
    hidden = torch.zeros(tokens, HIDDEN, dtype=dtype)
    triton_norm_rope.add_rms_norm(hidden, hidden, torch.ones(HIDDEN, dtype=dtype), 1e-5)


def _adapter_step(group_rows: list[int], gathered: bool = False) -> None:
    """One step's LoRA updates of SmolLM2-135M's q/k/v and down projections, rank-16 adapters on every part, a
    group per adapter (a gathered group last when asked)."""
    dtype, tokens, rank, intermediate = torch.bfloat16, sum(group_rows), 16, 1536
    firsts = [0, *itertools.accumulate(group_rows)]
    rows = [slice(first, first + n) for first, n in zip(firsts, group_rows, strict=False)]
    if gathered:
        rows[-1] = torch.arange(rows[-1].start, rows[-1].stop)
    for inputs, widths in (
        (HIDDEN, (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM)),
        (intermediate, (HIDDEN,)),
    ):
        ends = list(itertools.accumulate(widths))
        parts = [
            (end - w, end, torch.zeros(rank, w, dtype=dtype), i * rank)
            for i, (w, end) in enumerate(zip(widths, ends, strict=False))
        ]
        a = torch.zeros(len(widths) * rank, inputs, dtype=dtype)
        triton_lora.lora_add(
            torch.zeros(tokens, inputs, dtype=dtype),
            torch.zeros(tokens, ends[-1], dtype=dtype),
            [(r, a, parts) for r in rows],
        )


def engine_steps() -> dict[str, Callable[[], None]]:
    """Decode graphs (a batch padded to its graph's size, the block table as wide as max_model_len) at sizes
    that take each split count the H200 gets, with one sequence, 16 and neither; then eager steps (prefill,
    mixed batches, --enforce-eager) whose block tables are as wide as their longest sequence: one block, or odd."""
    steps = {}
    # 2048: the benches'; 8192: SmolLM2's context length, the engine's default
    for max_model_len in (2048, 8192):
        for batch in (1, 8, 16, 32, 128):
            name = f"decode graph of {batch} at max_model_len {max_model_len}"
            steps[name] = functools.partial(_engine_layer, [1] * batch, max_model_len // BLOCK_SIZE)
    for name, q_lens, width in (
        ("eager decode of 1 sequence in its first block", [1], 1),
        ("eager decode of 3 sequences, table 57 wide", [1, 1, 1], 57),
        ("prefill of a 5-token prompt", [5], 1),
        ("a 5-token prompt beside 2 decodes, all in their first block", [5, 1, 1], 1),
        ("a 512-token chunk of a 2048-token prompt", [512], 128),
        ("a 30-token chunk beside 2 decodes, table 44 wide", [30, 1, 1], 44),
    ):
        steps[name] = functools.partial(_engine_layer, q_lens, width)
    steps["decodes of 16 sequences over 8 adapters"] = functools.partial(_adapter_step, [2] * 8)
    steps["a 30-token chunk under an adapter beside gathered decodes"] = functools.partial(
        _adapter_step, [30, 3], True
    )
    return steps


def _attention_inputs(dtype, q_lens, seq_lens, block_size, kv_heads, group, head_dim):
    blocks = [-(-n // block_size) for n in seq_lens]
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    cache = torch.zeros(sum(blocks), block_size, kv_heads, head_dim, dtype=dtype)
    query = torch.zeros(sum(q_lens), kv_heads * group, head_dim, dtype=dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return query, cache, cache, table, torch.tensor(seq_lens, dtype=torch.int32), starts


def _every_wrapper(dtype, head_dim, group, block_size) -> None:
    """Decodes whole and split, a mixed batch, and the cache write, norms and rotary alongside."""
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
    bt = torch.zeros(8, 100, dtype=dtype)  # rank 8, below tl.dot's 16: padded
    parts = [(0, 100, bt, 0), (100, 150, bt[:, :50].contiguous(), 8)]
    lora = (slice(0, 3), torch.zeros(16, 576, dtype=dtype), parts)
    triton_lora.lora_add(hidden, torch.zeros(3, 150, dtype=dtype), [lora])


# (dtype, head dim, query heads per KV head, block size): SmolLM2-135M's attention in every input dtype, then
# bf16 with wider heads and other GQA ratios
SHAPES = [(dtype, 64, 3, 16) for dtype in (torch.bfloat16, torch.float32, torch.float16)]
SHAPES += [(torch.bfloat16, 128, 8, 32), (torch.bfloat16, 128, 1, 16)]


def shape_steps(shapes: list[tuple[torch.dtype, int, int, int]]) -> dict[str, Callable[[], None]]:
    return {
        f"{str(dtype).removeprefix('torch.')} head_dim {d} group {g} block {b}": functools.partial(
            _every_wrapper, dtype, d, g, b
        )
        for dtype, d, g, b in shapes
    }


class _TargetOnlyDriver:
    """All that the JIT asks of the driver until it launches: the target to compile for, and a device and a
    stream that it uses only as keys. Triton has no public way to have its launcher compile for a GPU that is
    not there (Triton 3.6 and 3.9 alike), so the check makes this the active driver while it compiles."""

    def __init__(self, target: GPUTarget) -> None:
        self.target = target

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> str:
        # keys the JIT's per-device caches, which hold the target: no real device's, one per architecture
        return f"sm_{self.target.arch} without a GPU"

    def get_current_stream(self, device) -> int:
        return 0


@contextlib.contextmanager
def targeting(arch: int) -> Iterator[None]:
    # driver.active would create the default driver, which fails without a GPU: hence the private field
    previous = driver._active
    driver.set_active(_TargetOnlyDriver(GPUTarget("cuda", arch, 32)))
    try:
        yield
    finally:
        driver.set_active(previous)


@dataclass(slots=True)
class Variant:
    """One kernel as compiled, and how the JIT specialised it: read from its TTIR and specialisation data."""

    kernel: str
    step: str  # the first step whose launch compiled to it
    constexprs: dict  # as the wrapper passed them
    constants: dict  # runtime arguments the JIT made constants (ints equal to 1)
    not_divisible: list[str]  # int and pointer arguments compiled without divisibility by 16
    shared: int  # bytes of shared memory
    seconds: float

    def __str__(self) -> str:
        constants = " ".join(f"{k}={v}" for k, v in self.constants.items()) or "-"
        return (
            f"{self.kernel} {self.constexprs}; constants {constants}; not divisible by 16: "
            f"{' '.join(self.not_divisible) or '-'}; {self.shared} B shared, {self.seconds:.1f} s; {self.step}"
        )


# a runtime argument of the kernel's function in TTIR: %stride_qt: i32 {tt.divisibility = 16 : i32} loc(...)
_TTIR_ARGUMENT = re.compile(r"%(\w+): ([^\s,)]+)(?: \{([^}]*)\})?")


def _variant(launch: Launch, compiled, seconds: float) -> Variant:
    name = launch.kernel.fn.__name__
    header = next(line for line in compiled.asm["ttir"].splitlines() if f"tt.func public @{name}(" in line)
    arguments = {m[1]: (m[2], m[3] or "") for m in _TTIR_ARGUMENT.finditer(header)}
    params = launch.kernel.params
    return Variant(
        kernel=name,
        step=launch.step,
        constexprs={p.name: compiled.src.constants[(p.num,)] for p in params if p.is_constexpr},
        constants={
            p.name: compiled.src.constants[(p.num,)]
            for p in params
            if not p.is_constexpr and p.name not in arguments
        },
        not_divisible=[
            arg
            for arg, (type_, attrs) in arguments.items()
            if (type_.startswith("i") or type_.startswith("!tt.ptr")) and "tt.divisibility = 16" not in attrs
        ],
        shared=compiled.metadata.shared,
        seconds=seconds,
    )


def compile_all(arch: int, launches: list[Launch]) -> list[Variant]:
    """Compiles each launch as its launcher would, with JITFunction.warmup: the launcher's own binding and
    specialisation of the arguments, then the compile, and no launch. One Variant per distinct kernel."""
    variants, seen = [], set()
    with targeting(arch):
        for launch in launches:
            what = (
                f"{launch.kernel.fn.__name__} ({launch.step}) for sm_{arch} with Triton {triton.__version__}"
            )
            start = time.perf_counter()
            try:
                compiled = launch.kernel.warmup(*launch.args, grid=(1,), **launch.kwargs)
            except Exception as error:
                raise RuntimeError(f"{what} does not compile") from error
            if compiled.hash in seen:  # the JIT's cache: specialised as an earlier launch was
                continue
            seen.add(compiled.hash)
            if not compiled.asm.get("cubin"):
                raise RuntimeError(f"{what}: no cubin")
            variants.append(_variant(launch, compiled, time.perf_counter() - start))
    return variants


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (90: H100/H200)")
    parser.add_argument("--quick", action="store_true", help="only the engine's launches (bf16 SmolLM2-135M)")
    args = parser.parse_args(argv)
    if interpreting():
        print("TRITON_INTERPRET=1 is set: unset it to compile", file=sys.stderr)
        return 2
    steps = engine_steps() if args.quick else engine_steps() | shape_steps(SHAPES)
    variants = compile_all(args.arch, record(steps))
    print("\n".join(map(str, variants)))
    print(f"compiled {len(variants)} kernel variants for sm_{args.arch} with Triton {triton.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
