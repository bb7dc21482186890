"""One check of the GPU path, JSON out, in sections that session.sh runs as separate processes:

- kernels: each Triton kernel against its torch twin, in each input dtype;
- e2e: the attention backends' greedy tokens on the same prompts, and one engine that sizes its KV cache by
  profiling GPU memory (bench/gpu/e2e.py);
- figures: decode-attention bandwidth as a share of the device's peak (beside torch SDPA over a gathered
  contiguous cache), output tokens/s at several concurrencies with CUDA graphs on and off, and output tokens/s
  of a batch over LoRA adapters against base only.

The JSON is rewritten after every row, so a process killed at its timeout keeps all it had produced; a section
that raises is reported with its traceback and the next one still runs. --toy shrinks every size, for a dry run
in Triton's interpreter on CPU (--device cpu).

python -m bench.gpu.check [--section all|kernels|e2e|figures] [--out FILE] [--peak-gbps 4800] [--toy]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from bench.gpu import e2e, kernel_checks
from bench.gpu.report import problems

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
TOY_DECODE_SHAPES = {"toy": (4, 2, 64)}


# what --toy sets, whatever else was asked: each section runs in seconds in Triton's interpreter
TOY_SIZES = {
    "decode_batch": 2,
    "decode_context": 40,
    "iters": 1,
    "e2e_concurrency": [2],
    "e2e_prompt_len": 8,
    "e2e_output_len": 3,
    "concurrency": [2],
    "prompt_len": 8,
    "output_len": 2,
    "kv_cache_memory": "16MiB",
    "lora_adapters": 2,
    "lora_streams": 2,
}
SECTIONS = {
    "kernels": ("correctness",),
    "e2e": ("end_to_end", "profiling"),
    "figures": ("decode_attention", "throughput", "adapters"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", default="all", choices=["all", *SECTIONS])
    parser.add_argument("--out", default=None, help="also write the JSON here, rewritten after every row")
    parser.add_argument(
        "--toy", action="store_true", help="toy sizes everywhere (overrides them), for a dry run"
    )
    parser.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu: Triton's interpreter, to test this script",
    )
    parser.add_argument(
        "--budget-s", type=float, default=420, help="start no engine that would end after this"
    )
    parser.add_argument("--peak-gbps", type=float, default=None, help="device peak memory bandwidth in GB/s")
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--decode-context", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=50, help="timed calls per decode variant")
    parser.add_argument("--model", default=None, help="the model to serve (default: the default model)")
    parser.add_argument("--no-model", action="store_true", help="none to serve: engine rows say skipped")
    parser.add_argument(
        "--kv-cache-memory", default="16GiB", help="KV pool of every engine but the profiled one"
    )
    parser.add_argument(
        "--e2e-backends",
        default="triton,triton-eager,torch,triton+fp8",
        help="e2e: attention backends whose greedy tokens are compared; -eager: no CUDA graphs, +Q: --quantization Q",
    )
    parser.add_argument("--e2e-concurrency", default="1,8", help="e2e: concurrent requests")
    parser.add_argument(
        "--e2e-dtypes",
        default="float32,bfloat16",
        help="e2e: each backend's greedy tokens in each dtype (judged in float32 only; see e2e.py)",
    )
    parser.add_argument(
        "--profiling-quantizations",
        default="auto,fp8",
        help="e2e: the engine sized by profiling GPU memory is started once with each of these --quantization",
    )
    parser.add_argument("--e2e-prompt-len", type=int, default=128)
    parser.add_argument("--e2e-output-len", type=int, default=32)
    parser.add_argument(
        "--throughput-backends",
        default="triton,triton-eager,triton+fp8",
        help="figures: backends timed (graphs on, off; fp8 weights and activations)",
    )
    parser.add_argument("--concurrency", default="1,64,256", help="figures: concurrent requests timed")
    parser.add_argument("--prompt-len", type=int, default=512, help="figures: prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="figures: output tokens")
    parser.add_argument(
        "--lora-adapters", type=int, default=8, help="figures: adapters the batch is spread over"
    )
    parser.add_argument(
        "--lora-streams", type=int, default=16, help="figures: requests in the adapters' batch"
    )
    args = parser.parse_args(argv)
    for name in ("concurrency", "e2e_concurrency"):
        setattr(args, name, [int(n) for n in getattr(args, name).split(",")])
    from executor import QUANTIZATIONS

    args.profiling_quantizations = args.profiling_quantizations.split(",")
    args.e2e_dtypes = args.e2e_dtypes.split(",")
    if unknown := [d for d in args.e2e_dtypes if d not in ("auto", "float32", "bfloat16", "float16")]:
        parser.error(f"--e2e-dtypes: {', '.join(unknown)} not in auto, float32, bfloat16, float16")
    if unknown := [q for q in args.profiling_quantizations if q not in QUANTIZATIONS]:
        parser.error(f"--profiling-quantizations: {', '.join(unknown)} not in {', '.join(QUANTIZATIONS)}")
    for name in ("e2e_backends", "throughput_backends"):
        setattr(args, name, getattr(args, name).split(","))
        for backend in getattr(args, name):
            try:
                e2e.split_backend(backend)
            except ValueError as error:
                parser.error(f"--{name.replace('_', '-')}: {error}")
    args.attention_cases, args.tolerance = kernel_checks.ATTENTION_CASES, kernel_checks.TOLERANCE
    args.decode_shapes, args.fp8_cases = DECODE_SHAPES, kernel_checks.FP8_CASES
    if args.toy:
        vars(args).update(TOY_SIZES)
        args.attention_cases, args.tolerance, args.decode_shapes = (
            kernel_checks.TOY_ATTENTION_CASES,
            kernel_checks.TOY_TOLERANCE,
            TOY_DECODE_SHAPES,
        )
        args.fp8_cases = kernel_checks.TOY_FP8_CASES
    return args


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


def decode_benchmark(args: argparse.Namespace, peak: float | None) -> Iterator[dict]:
    """Decode attention over a bf16 paged cache, for each shape in args.decode_shapes."""
    for shape_name, (heads, kv_heads, dim) in args.decode_shapes.items():
        yield from _decode_shape(shape_name, heads, kv_heads, dim, args, peak)
        if args.device == "cuda":
            torch.cuda.empty_cache()


def _decode_shape(
    shape_name: str, heads: int, kv_heads: int, dim: int, args: argparse.Namespace, peak: float | None
) -> Iterator[dict]:
    """Triton (as chosen, and unsplit), our torch path, and torch SDPA over contiguous K/V, with and without
    the gather that makes them contiguous."""
    import torch.nn.functional as F

    from kvkernels import torch_paged, triton_attention

    batch, context, bs = args.decode_batch, args.decode_context, args.block_size
    paged = kernel_checks.paged_batch(
        [1] * batch, [context] * batch, heads, kv_heads, dim, bs, torch.bfloat16, args.device
    )
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
    for name, fn in variants.items():
        out = fn()
        seconds = time_calls(fn, args.device, args.iters)
        yield {
            "shape": shape_name,
            "variant": name,
            "batch": batch,
            "context": context,
            "us_per_call": round(seconds * 1e6, 1),
            "bytes_moved": moved,
            **bandwidth(moved, seconds, peak),
            "max_error_vs_sdpa": kernel_checks.max_error(out.reshape(baseline.shape), baseline),
        }


def device_problem(device: str) -> str | None:
    """Why this machine cannot run the check, or None."""
    from kvkernels.triton_mode import interpreting, triton_available

    if not triton_available():
        return "the GPU check needs the triton package (pip install triton)"
    if device == "cpu":
        return (
            None
            if interpreting()
            else "--device cpu runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1"
        )
    if not torch.cuda.is_available():
        return "the GPU check needs a CUDA device, and torch sees none (torch.cuda.is_available() is False)"
    if interpreting():
        return "the GPU check measures compiled kernels: unset TRITON_INTERPRET"
    return None


class ReportFile:
    """The report, written whole to its file after every row: a process killed mid-section keeps what it made."""

    def __init__(self, path: str | None, header: dict) -> None:
        self.path = None if path is None else Path(path)
        self.data = dict(header)
        self._write()

    def begin(self, section: str) -> None:
        self.data[section] = []  # present though empty: the section ran
        self._write()

    def add(self, section: str, row: dict) -> None:
        self.data[section].append(row)
        self._write()

    def fail(self, section: str, error: Exception) -> None:
        self.data.setdefault("errors", {})[section] = {
            "error": repr(error),
            "traceback": traceback.format_exc(),
        }
        self._write()

    def set(self, key: str, value: object) -> None:
        self.data[key] = value
        self._write()

    def _write(self) -> None:
        if self.path is None:
            return
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(json.dumps(self.data, indent=2) + "\n")
        os.replace(partial, self.path)  # a kill mid-write leaves the previous whole file, never half of one


def section_rows(
    key: str, args: argparse.Namespace, peak: float | None, clock: e2e.EngineClock
) -> Iterator[dict]:
    if key == "correctness":
        return kernel_checks.correctness(args.device, args.attention_cases, args.tolerance, args.fp8_cases)
    if key == "decode_attention":
        return decode_benchmark(args, peak)
    if args.no_model:
        return iter([{"skipped": "no model"}])
    engine_runs = {
        "end_to_end": e2e.agreement,
        "profiling": e2e.profiled_start,
        "throughput": e2e.throughput,
        "adapters": e2e.adapter_throughput,
    }
    return engine_runs[key](args, clock)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = device_problem(args.device)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    import triton

    started = time.perf_counter()
    clock = e2e.EngineClock(started + args.budget_s)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton interpreter)"
    peak = peak_gbps(name, args.peak_gbps)
    header = {
        "device": name,
        "peak_gbps": peak,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "bandwidth_basis": "bytes decode attention must move (K, V, queries, outputs, block tables) per second, "
        "whatever a variant moves in fact",
    }
    report = ReportFile(args.out, header)
    sections = SECTIONS.values() if args.section == "all" else [SECTIONS[args.section]]
    for key in (key for keys in sections for key in keys):
        report.begin(key)
        # a section that fails is reported with its traceback, and the others still run
        try:
            for row in section_rows(key, args, peak, clock):
                report.add(key, row)
        except Exception as error:
            traceback.print_exc()
            report.fail(key, error)
        print(f"{key} done at {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    report.set("seconds", round(time.perf_counter() - started, 1))
    print(json.dumps(report.data, indent=2))
    return 1 if problems(report.data) else 0


if __name__ == "__main__":
    sys.exit(main())
