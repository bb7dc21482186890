"""check.py's kernels section: each Triton kernel against its torch twin on random inputs, in each input dtype,
and the fp8 layer against the product of its dequantized weights. A case that raises is reported failed with its
error, and the next still runs."""

from __future__ import annotations

import traceback
from collections.abc import Iterator

import torch

from kvkernels import torch_twins

# input dtype -> largest error allowed, relative to 1 + |expected| (see max_error)
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}
# fp8 (e4m3) weights and activations: the norm of the error against the product of the dequantized weights, relative
# to the product's norm. e4m3 keeps 3 mantissa bits, about 2^-4 of each factor before the sums average it down.
FP8_TOLERANCE = 0.05
# (rows, inputs, outputs) of the default model's linear layers at a decode, a small and a large batch
FP8_CASES = [(1, 576, 1536), (33, 576, 640), (256, 1536, 576), (256, 576, 49152)]
TOY_FP8_CASES = [(1, 64, 32), (17, 64, 48)]
# name -> (q_lens, seq_lens, heads, kv_heads, head_dim, block_size, num_kv_splits)
ATTENTION_CASES = {
    "mixed-gqa3-d64-b16": ([1, 1, 20, 9, 1], [1, 37, 20, 50, 33], 9, 3, 64, 16, None),
    "mixed-gqa8-d128-b32": ([1, 1, 20, 9, 1], [1, 37, 20, 50, 33], 16, 2, 128, 32, None),
    "mixed-mha-d128-b16": ([3, 1, 64], [300, 2000, 64], 4, 4, 128, 16, None),
    "decode-2000-split1": ([1], [2000], 8, 1, 128, 16, 1),
    "decode-2000-split4": ([1], [2000], 8, 1, 128, 32, 4),
    "decodes-auto-split": ([1] * 8, [1, 5, 100, 700, 1500, 2000, 17, 64], 32, 8, 128, 16, None),
}
TOY_ATTENTION_CASES = {"mixed": ([1, 7, 1], [40, 7, 17], 4, 2, 64, 16, None)}
TOY_TOLERANCE = {torch.float32: TOLERANCE[torch.float32], torch.bfloat16: TOLERANCE[torch.bfloat16]}


def paged_batch(
    q_lens: list[int],
    seq_lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """query, key_cache, value_cache, block_table, seq_lens, query_start_loc, blocks in shuffled order."""
    g = torch.Generator(device=device).manual_seed(seed)
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 1
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, generator=g, device=device).to(dtype)
    value_cache = torch.randn(cache_shape, generator=g, device=device).to(dtype)
    order = torch.randperm(num_blocks, generator=g, device=device).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=device)
    start = 0
    for s, n in enumerate(blocks):
        table[s, :n] = order[start : start + n]
        start += n
    query = torch.randn(sum(q_lens), heads, head_dim, generator=g, device=device).to(dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return query, key_cache, value_cache, table, lens, starts


def max_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest difference relative to 1 + |expected|: absolute near zero, relative (as rounding is) above."""
    expected = expected.float().to(got.device)
    return ((got.float() - expected).abs() / (1 + expected.abs())).max().item()


def correctness(
    device: str, cases: dict, tolerance: dict, fp8_cases: list[tuple[int, int, int]]
) -> Iterator[dict]:
    """Each Triton kernel against its torch twin, in each input dtype, then the fp8 layer. A case that raises is
    reported failed with its error, and the next still runs (after a CUDA fault, which poisons the process, they
    fail too)."""
    checks = [(f"paged_attention/{name}", case) for name, case in cases.items()]
    checks += [
        (kernel, None)
        for kernel in ("reshape_and_cache", "rms_norm", "add_rms_norm", "rotary_embedding", "lora_add")
    ]
    for dtype, tol in tolerance.items():
        for kernel, case in checks:
            row = {"kernel": kernel, "dtype": str(dtype).removeprefix("torch.")}
            try:
                error = kernel_error(kernel, case, dtype, device)
            except Exception as failure:
                traceback.print_exc()
                yield row | {"error": repr(failure), "ok": False}
                continue
            limit = 0.0 if kernel == "reshape_and_cache" else tol  # a copy: exact
            yield row | {"max_error": error, "ok": error <= limit}
    yield from fp8_correctness(device, fp8_cases)


def fp8_correctness(device: str, cases: list[tuple[int, int, int]]) -> Iterator[dict]:
    """--quantization fp8's layer against the float product of its dequantized weights. On a CUDA device the
    row must have gone through torch's scaled matmul (w8a8), else it is not ok: the emulation would pass for it."""
    from kvkernels.weight_quantization import Fp8Linear

    for rows, inputs, outputs in cases:
        row = {"kernel": f"fp8_linear/{rows}x{inputs}x{outputs}", "dtype": "float8_e4m3fn"}
        try:
            g = torch.Generator(device=device).manual_seed(rows)
            linear = torch.nn.Linear(inputs, outputs, bias=False, device=device, dtype=torch.bfloat16)
            torch.nn.init.normal_(linear.weight, std=inputs**-0.5, generator=g)
            layer = Fp8Linear(linear)
            x = torch.randn(rows, inputs, generator=g, device=device).to(torch.bfloat16)
            expected = x.float() @ layer.dequantize(torch.float32).t()
            error = ((layer(x).float() - expected).norm() / expected.norm()).item()
        except Exception as failure:
            traceback.print_exc()
            yield row | {"error": repr(failure), "ok": False}
            continue
        scaled = layer._scaled
        yield row | {
            "max_error": error,
            "scaled_mm": scaled,
            "ok": error <= FP8_TOLERANCE and (scaled or device != "cuda"),
        }


def kernel_error(kernel: str, case: tuple | None, dtype: torch.dtype, device: str) -> float:
    """The Triton kernel's largest error against its twin's (see max_error), on random inputs."""
    from kvkernels import triton_attention, triton_cache, triton_lora, triton_norm_rope

    if case is not None:
        q_lens, lens, heads, kv_heads, dim, bs, splits = case
        args = paged_batch(q_lens, lens, heads, kv_heads, dim, bs, dtype, device)
        got = triton_attention.paged_attention(*args, scale=dim**-0.5, num_kv_splits=splits)
        # the twin builds its masks on the CPU
        return max_error(got, torch_twins.paged_attention(*(a.cpu() for a in args), scale=dim**-0.5))
    if kernel == "reshape_and_cache":
        key = torch.randn(40, 3, 64, device=device).to(dtype)
        caches = [torch.zeros(8, 16, 3, 64, dtype=dtype, device=device) for _ in range(4)]
        slots = torch.randperm(128, device=device)[:40]
        triton_cache.reshape_and_cache(key, key * 2, caches[0], caches[1], slots)
        torch_twins.reshape_and_cache(key, key * 2, caches[2], caches[3], slots)
        return max(max_error(caches[0], caches[2]), max_error(caches[1], caches[3]))
    if kernel == "lora_add":
        x, out, groups = lora_step(dtype, device)
        expected = out.clone()
        torch_twins.lora_add(x, expected, groups)
        triton_lora.lora_add(x, out, groups)
        return max_error(out, expected)
    x, residual = (torch.randn(33, 576, device=device).to(dtype) for _ in range(2))
    weight = torch.randn(576, device=device).to(dtype)
    if kernel == "rms_norm":
        return max_error(triton_norm_rope.rms_norm(x, weight, 1e-5), torch_twins.rms_norm(x, weight, 1e-5))
    if kernel == "add_rms_norm":
        got = triton_norm_rope.add_rms_norm(x, residual, weight, 1e-5)
        expected = torch_twins.add_rms_norm(x, residual, weight, 1e-5)
        return max(max_error(a, b) for a, b in zip(got, expected, strict=True))
    angles = torch.randn(33, 32, device=device).repeat(1, 2) * 100
    q = torch.randn(33, 9, 64, device=device).to(dtype)
    k = torch.randn(33, 3, 64, device=device).to(dtype)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    got = triton_norm_rope.rotary_embedding(q, k, cos, sin)
    expected = torch_twins.rotary_embedding(q, k, cos, sin)
    return max(max_error(a, b) for a, b in zip(got, expected, strict=True))


def lora_step(dtype: torch.dtype, device: str, rank: int = 16) -> tuple[torch.Tensor, torch.Tensor, list]:
    """x, the q/k/v projection's output and its groups for one step of the default model under four adapters on
    q, k and v: groups of 1, 2 and 33 rows and 7 gathered ones, base rows between. A and B are scaled so that the
    shrunk rows and the update stay about one."""
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    hidden, widths = 576, (576, 192, 192)
    starts = (0, 576, 768)
    x, out = randn(48, hidden), randn(48, sum(widths))
    gathered = torch.tensor([3, 5, 6, 40, 41, 44, 47], device=device)
    groups = []
    for rows in (slice(0, 1), slice(1, 3), gathered, slice(7, 40)):
        parts = [
            (start, start + width, randn(rank, width, scale=rank**-0.5), i * rank)
            for i, (start, width) in enumerate(zip(starts, widths, strict=True))
        ]
        groups.append((rows, randn(len(widths) * rank, hidden, scale=hidden**-0.5), parts))
    return x, out, groups
