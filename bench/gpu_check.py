"""One check of the GPU path, JSON out: the Triton kernels against their torch twins on CUDA, decode-attention
bandwidth as a share of the device's peak (beside torch SDPA over a gathered contiguous cache), and end-to-end
output tokens/s of the default model at several concurrencies. Sized to finish within 8 minutes on one GPU.

python -m bench.gpu_check [--peak-gbps 4800] [--out gpu_check.json] [--skip-e2e]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
import traceback
from collections.abc import Callable

import torch

from kernels import reference

# peak memory bandwidth in GB/s by device name; the first entry whose key the name contains wins, so the
# more specific names come first
PEAK_GBPS = {
    "H200": 4800,
    "H100 NVL": 3900,
    "H100 PCIe": 2000,
    "H100": 3350,  # SXM, "NVIDIA H100 80GB HBM3"
    "GH200": 4000,
    "B200": 8000,
    "A100-SXM4-80GB": 2039,
    "A100 80GB PCIe": 1935,
    "A100": 1555,  # the 40 GB parts
    "L40S": 864,
    "L4": 300,
    "A10G": 600,
    "RTX 4090": 1008,
}

# attention shapes for the decode benchmark: (query heads, KV heads, head dim)
DECODE_SHAPES = {"llama3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}


# input dtype -> largest error allowed, relative to 1 + |expected| (see _max_error)
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}
# name -> (q_lens, seq_lens, heads, kv_heads, head_dim, block_size, num_kv_splits)
ATTENTION_CASES = {
    "mixed-gqa3-d64-b16": ([1, 1, 20, 9, 1], [1, 37, 20, 50, 33], 9, 3, 64, 16, None),
    "mixed-gqa8-d128-b32": ([1, 1, 20, 9, 1], [1, 37, 20, 50, 33], 16, 2, 128, 32, None),
    "mixed-mha-d128-b16": ([3, 1, 64], [300, 2000, 64], 4, 4, 128, 16, None),
    "decode-2000-split1": ([1], [2000], 8, 1, 128, 16, 1),
    "decode-2000-split4": ([1], [2000], 8, 1, 128, 32, 4),
    "decodes-auto-split": ([1] * 8, [1, 5, 100, 700, 1500, 2000, 17, 64], 32, 8, 128, 16, None),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peak-gbps", type=float, default=None, help="device peak memory bandwidth in GB/s")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--decode-context", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--model", default=None, help="end-to-end model (default: the default model)")
    parser.add_argument("--concurrency", default="1,16,64,256", help="end-to-end concurrent requests")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--e2e-backends",
        default="triton,triton-eager,torch",
        help="attention backends to serve with; -eager: no CUDA graphs",
    )
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--budget-s", type=float, default=420, help="skip what would start after this")
    parser.add_argument("--kv-cache-memory", default="16GiB", help="end-to-end KV pool")
    parser.add_argument("--iters", type=int, default=50, help="timed calls per decode variant")
    parser.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu: Triton's interpreter, to test this script",
    )
    args = parser.parse_args(argv)
    args.concurrency = [int(n) for n in args.concurrency.split(",")]
    args.e2e_backends = args.e2e_backends.split(",")
    for backend in args.e2e_backends:
        try:
            split_backend(backend)
        except ValueError as error:
            parser.error(f"--e2e-backends: {error}")
    return args


def split_backend(backend: str) -> tuple[str, bool]:
    """'triton-eager' -> ('triton', True): the attention backend, and whether CUDA graphs are off."""
    from shared.engine_config import ATTENTION_BACKENDS

    name, _, mode = backend.partition("-")
    if name not in ATTENTION_BACKENDS or mode not in ("", "eager"):
        raise ValueError(f"{backend!r} is not auto, torch or triton, optionally with -eager")
    return name, mode == "eager"


def peak_gbps(device_name: str, override: float | None = None) -> float | None:
    if override is not None:
        return override
    return next((gbps for key, gbps in PEAK_GBPS.items() if key in device_name), None)


def decode_bytes(
    batch: int, context: int, heads: int, kv_heads: int, head_dim: int, itemsize: int, block_size: int
) -> int:
    """What one decode-attention call must move: every sequence's K and V, its query in, its output out, and
    its row of the block table."""
    kv = 2 * batch * context * kv_heads * head_dim * itemsize
    q_and_out = 2 * batch * heads * head_dim * itemsize
    tables = batch * -(-context // block_size) * 4
    return kv + q_and_out + tables


def bandwidth(num_bytes: int, seconds: float, peak: float | None) -> dict:
    achieved = num_bytes / seconds / 1e9
    return {
        "achieved_gbps": round(achieved, 1),
        "share_of_peak": None if peak is None else round(achieved / peak, 3),
    }


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


def _max_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest difference relative to 1 + |expected|: absolute near zero, relative (as rounding is) above."""
    expected = expected.float().to(got.device)
    return ((got.float() - expected).abs() / (1 + expected.abs())).max().item()


def correctness(device: str) -> list[dict]:
    """Each Triton kernel against its torch twin, in each input dtype."""
    from kernels import triton_attention, triton_cache, triton_norm_rope

    results = []
    for dtype, tol in TOLERANCE.items():
        for name, (q_lens, lens, heads, kv_heads, dim, bs, splits) in ATTENTION_CASES.items():
            args = paged_batch(q_lens, lens, heads, kv_heads, dim, bs, dtype, device)
            got = triton_attention.paged_attention(*args, scale=dim**-0.5, num_kv_splits=splits)
            # the twin builds its masks on the CPU
            expected = reference.paged_attention(*(a.cpu() for a in args), scale=dim**-0.5)
            results.append(_case(f"paged_attention/{name}", dtype, _max_error(got, expected), tol))
        key = torch.randn(40, 3, 64, device=device).to(dtype)
        caches = [torch.zeros(8, 16, 3, 64, dtype=dtype, device=device) for _ in range(4)]
        slots = torch.randperm(128, device=device)[:40]
        triton_cache.reshape_and_cache(key, key * 2, caches[0], caches[1], slots)
        reference.reshape_and_cache(key, key * 2, caches[2], caches[3], slots)
        error = max(_max_error(caches[0], caches[2]), _max_error(caches[1], caches[3]))
        results.append(_case("reshape_and_cache", dtype, error, 0.0))
        x, residual = (torch.randn(33, 576, device=device).to(dtype) for _ in range(2))
        weight = torch.randn(576, device=device).to(dtype)
        error = _max_error(triton_norm_rope.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))
        results.append(_case("rms_norm", dtype, error, tol))
        got = triton_norm_rope.add_rms_norm(x, residual, weight, 1e-5)
        expected = reference.add_rms_norm(x, residual, weight, 1e-5)
        error = max(_max_error(a, b) for a, b in zip(got, expected, strict=True))
        results.append(_case("add_rms_norm", dtype, error, tol))
        angles = torch.randn(33, 32, device=device).repeat(1, 2) * 100
        q, k = (
            torch.randn(33, 9, 64, device=device).to(dtype),
            torch.randn(33, 3, 64, device=device).to(dtype),
        )
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        got = triton_norm_rope.rotary_embedding(q, k, cos, sin)
        expected = reference.rotary_embedding(q, k, cos, sin)
        error = max(_max_error(a, b) for a, b in zip(got, expected, strict=True))
        results.append(_case("rotary_embedding", dtype, error, tol))
    return results


def _case(name: str, dtype: torch.dtype, error: float, tolerance: float) -> dict:
    return {
        "kernel": name,
        "dtype": str(dtype).removeprefix("torch."),
        "max_error": error,
        "ok": error <= tolerance,
    }


def time_calls(fn: Callable[[], object], device: str, iters: int = 50, warmup: int = 5) -> float:
    """Mean seconds per call, by CUDA events around `iters` back-to-back calls (on CPU, by the clock)."""
    for _ in range(warmup):
        fn()
    if device != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def decode_benchmark(args: argparse.Namespace, peak: float | None) -> list[dict]:
    """Decode attention over a bf16 paged cache, for each shape in DECODE_SHAPES."""
    results = []
    for shape_name, (heads, kv_heads, dim) in DECODE_SHAPES.items():
        results += _decode_shape(shape_name, heads, kv_heads, dim, args, peak)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return results


def _decode_shape(
    shape_name: str, heads: int, kv_heads: int, dim: int, args: argparse.Namespace, peak: float | None
) -> list[dict]:
    """Triton (as chosen, and unsplit), our torch path, and torch SDPA over contiguous K/V, with and without
    the gather that makes them contiguous."""
    import torch.nn.functional as F

    from kernels import torch_paged, triton_attention

    batch, context, bs = args.decode_batch, args.decode_context, args.block_size
    paged = paged_batch([1] * batch, [context] * batch, heads, kv_heads, dim, bs, torch.bfloat16, args.device)
    query, key_cache, value_cache, table = paged[:4]
    scale = dim**-0.5
    moved = decode_bytes(batch, context, heads, kv_heads, dim, 2, bs)

    def gather(cache: torch.Tensor) -> torch.Tensor:  # [B, Hkv, L, D], contiguous
        return cache[table.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()

    k, v = gather(key_cache), gather(value_cache)
    q = query.unsqueeze(2)  # [B, Hq, 1, D]

    def sdpa_contiguous() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    def sdpa_after_gather() -> torch.Tensor:
        kg, vg = gather(key_cache), gather(value_cache)
        return F.scaled_dot_product_attention(q, kg, vg, scale=scale, enable_gqa=True)

    variants = {
        "triton": lambda: triton_attention.paged_attention(*paged, scale=scale),
        "triton-no-split": lambda: triton_attention.paged_attention(*paged, scale=scale, num_kv_splits=1),
        "torch-paged": lambda: torch_paged.paged_attention(*paged, scale=scale),
        "sdpa-contiguous-cache": sdpa_contiguous,
        "sdpa-gather-then-attend": sdpa_after_gather,
    }
    baseline = sdpa_contiguous().squeeze(2)
    results = []
    for name, fn in variants.items():
        out = fn()
        seconds = time_calls(fn, args.device, args.iters)
        results.append(
            {
                "shape": shape_name,
                "variant": name,
                "batch": batch,
                "context": context,
                "us_per_call": round(seconds * 1e6, 1),
                "bytes_moved": moved,
                **bandwidth(moved, seconds, peak),
                "max_error_vs_sdpa": _max_error(out.reshape(baseline.shape), baseline),
            }
        )
    return results


def end_to_end(args: argparse.Namespace, deadline: float) -> list[dict]:
    """Offline serving of the default model on CUDA: N requests at once, output tokens/s until all finish, for
    each backend in --e2e-backends ("triton" captures decode graphs, "triton-eager" does not). A backend that
    fails is reported with its error and the next one still runs. Each row also says how many of its greedy
    tokens match the first backend's on the same prompts."""
    results: list[dict] = []
    first_tokens: dict[int, list[list[int]]] = {}  # concurrency -> the first backend's tokens
    for backend in args.e2e_backends:
        try:
            results += _serve(args, backend, deadline, first_tokens)
        except Exception as error:
            traceback.print_exc()
            results.append({"backend": backend, "error": repr(error), "traceback": traceback.format_exc()})
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return results


def _serve(args: argparse.Namespace, backend: str, deadline: float, first_tokens: dict) -> list[dict]:
    from executor import LLM, SamplingParams

    name, enforce_eager = split_backend(backend)
    started = time.perf_counter()
    llm = LLM(
        args.model,
        device=args.device,
        attention_backend=name,
        kv_cache_memory=args.kv_cache_memory,
        enforce_eager=enforce_eager,
    )
    start_s = round(time.perf_counter() - started, 1)
    graphs = llm.engine.runner.decode_graphs
    rng = random.Random(0)  # every backend gets the same prompts
    vocab = llm.engine.vocab_size
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    results = []
    for n in args.concurrency:
        if time.perf_counter() > deadline:
            results.append({"backend": backend, "concurrency": n, "skipped": "time budget spent"})
            continue
        # warm-up (Triton compiles the shapes of this batch) on other prompts: the prefix cache must not hold
        # the measured ones
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(2 * n)]
        llm.generate(prompts[n:], SamplingParams(max_tokens=2, ignore_eos=True))
        prompts = prompts[:n]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)  # the tokens reach the host: no sync needed
        seconds = time.perf_counter() - start
        tokens = [list(out.outputs[0].token_ids) for out in outputs]
        expected = first_tokens.setdefault(n, tokens)
        same = sum(
            a == b for got, want in zip(tokens, expected, strict=True) for a, b in zip(got, want, strict=True)
        )
        total = sum(len(t) for t in tokens)
        results.append(
            {
                "backend": backend,
                "cuda_graphs": graphs is not None,
                "engine_start_s": start_s,
                "concurrency": n,
                "prompt_len": args.prompt_len,
                "output_len": args.output_len,
                "output_tokens": total,
                "seconds": round(seconds, 2),
                "output_tok_s": round(total / seconds, 1),
                "tokens_matching_first_backend": round(same / total, 3),
            }
        )
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    return results


def device_problem(device: str) -> str | None:
    """Why this machine cannot run the check, or None."""
    from kernels.triton_mode import interpreting, triton_available

    if not triton_available():
        return "gpu_check needs the triton package (pip install triton)"
    if device == "cpu":
        return (
            None
            if interpreting()
            else "--device cpu runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1"
        )
    if not torch.cuda.is_available():
        return "gpu_check needs a CUDA device, and torch sees none (torch.cuda.is_available() is False)"
    if interpreting():
        return "gpu_check measures compiled kernels: unset TRITON_INTERPRET"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = device_problem(args.device)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    deadline = started + args.budget_s
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton interpreter)"
    peak = peak_gbps(name, args.peak_gbps)
    report: dict = {
        "device": name,
        "peak_gbps": peak,
        "torch": torch.__version__,
        "bandwidth_basis": "bytes decode attention must move (K, V, queries, outputs, block tables) per second, "
        "whatever a variant moves in fact",
    }
    import triton

    report["triton"] = triton.__version__
    sections = {
        "correctness": lambda: correctness(args.device),
        "decode_attention": lambda: decode_benchmark(args, peak),
        "end_to_end": lambda: [] if args.skip_e2e else end_to_end(args, deadline),
    }
    failed = False
    for key, run in sections.items():
        # a section that fails is reported with its traceback, and the others still run: one GPU session
        # should bring back all it can
        try:
            report[key] = run()
        except Exception as error:
            traceback.print_exc()
            report[key] = {"error": repr(error), "traceback": traceback.format_exc()}
            failed = True
        print(f"{key} done at {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    correct = report["correctness"]
    report["all_correct"] = isinstance(correct, list) and all(case["ok"] for case in correct)
    report["seconds"] = round(time.perf_counter() - started, 1)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if report["all_correct"] and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
