"""check.py's engine runs: the model served offline on one device, each section's rows yielded as they come.

- agreement: each attention backend's greedy tokens on the same prompts, against the first backend's;
- profiled_start: one engine started as `kvserve up` starts it, without kv_cache_memory, so it sizes its KV cache
  by profiling GPU memory (executor/kv/sizing.py); it reports the blocks it got and the profiling log line;
- throughput: output tokens/s at each concurrency, per backend ("-eager": no CUDA graphs);
- adapter_throughput: output tokens/s of one batch of requests spread over random LoRA adapters, against the same
  batch on the base model, in one engine.

An engine build is not started where the deadline would pass before it is up: EngineClock guesses its time from
the last build's, or from ENGINE_START_GUESS_S before the first.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

# a first build on an H200: weights, graph capture of up to 35 batch sizes, the kernels' first compiles (a guess
# until a build has been timed)
ENGINE_START_GUESS_S = 30.0
BUDGET_SPENT = "time budget spent"
# Two correct backends may part ways where the first one's top two tokens were this close (in nats: their logits'
# difference). In float32, kernels that sum in another order move a logit by about 1e-5; where two backends part
# at a wider margin than this, one of them computed something else. Backends are judged in float32 alone: the
# stand-in's random weights give bf16 logits near-ties of a step or more (0.125 to 0.5 at its logits' size)
# every few tokens, so there a parting says nothing (the first H200 sessions saw 3 to 44% of tokens agree, with
# partings at up to 0.44 nats); bf16's rows are reported, and its kernels are held to their twins instead.
NEAR_TIE_NATS = 0.01
JUDGED_DTYPE = "float32"


def split_backend(backend: str) -> tuple[str, bool, str]:
    """'triton-eager+fp8' -> ('triton', True, 'fp8'): the attention backend, whether CUDA graphs are off, and the
    weights' --quantization (auto where none is named)."""
    from executor import ATTENTION_BACKENDS, QUANTIZATIONS

    engine, _, quantization = backend.partition("+")
    name, _, mode = engine.partition("-")
    if name not in ATTENTION_BACKENDS or mode not in ("", "eager"):
        raise ValueError(f"{backend!r} is not auto, torch or triton, optionally with -eager")
    if "+" in backend and quantization not in QUANTIZATIONS:
        raise ValueError(f"{backend!r}: +{quantization} is not a quantization ({', '.join(QUANTIZATIONS)})")
    return name, mode == "eager", quantization or "auto"


class EngineClock:
    """Builds engines while the deadline leaves room for one, timing each to guess the next."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.last_build_s: float | None = None

    def has_room(self) -> bool:
        guess = ENGINE_START_GUESS_S if self.last_build_s is None else self.last_build_s
        return time.perf_counter() + guess <= self.deadline

    def past_deadline(self) -> bool:
        return time.perf_counter() > self.deadline

    def build(self, model: str | None, **engine_args):
        from executor import LLM

        started = time.perf_counter()
        llm = LLM(model, **engine_args)
        self.last_build_s = time.perf_counter() - started
        return llm


@dataclass(frozen=True, slots=True)
class Workload:
    """What each backend serves: `concurrency` requests at once, each prompt_len random tokens in, output_len out;
    timed runs are preceded by a warm-up on other prompts (Triton compiles the batch's shapes there)."""

    concurrency: list[int]
    prompt_len: int
    output_len: int
    timed: bool
    dtype: str = "auto"  # the engine's: bfloat16 on CUDA


def agreement(args: argparse.Namespace, clock: EngineClock) -> Iterator[dict]:
    for dtype in args.e2e_dtypes:
        workload = Workload(
            args.e2e_concurrency, args.e2e_prompt_len, args.e2e_output_len, timed=False, dtype=dtype
        )
        yield from _each_backend(args, args.e2e_backends, workload, clock)


def throughput(args: argparse.Namespace, clock: EngineClock) -> Iterator[dict]:
    workload = Workload(args.concurrency, args.prompt_len, args.output_len, timed=True)
    yield from _each_backend(args, args.throughput_backends, workload, clock)


def _each_backend(
    args: argparse.Namespace, backends: list[str], workload: Workload, clock: EngineClock
) -> Iterator[dict]:
    """A backend that fails is reported with its error, and the next one still runs."""
    first_runs: dict[int, list] = {}  # concurrency -> the first backend's outputs
    for backend in backends:
        if not clock.has_room():
            yield {"backend": backend, "skipped": BUDGET_SPENT}
            continue
        try:
            yield from _serve(args, backend, workload, clock, first_runs)
        except Exception as error:
            traceback.print_exc()
            yield {"backend": backend, "error": repr(error), "traceback": traceback.format_exc()}
        _free_device_memory(args.device)


def _serve(
    args: argparse.Namespace, backend: str, workload: Workload, clock: EngineClock, first_runs: dict
) -> Iterator[dict]:
    from executor import SamplingParams

    name, enforce_eager, quantization = split_backend(backend)
    llm = clock.build(
        args.model,
        device=args.device,
        attention_backend=name,
        kv_cache_memory=args.kv_cache_memory,
        enforce_eager=enforce_eager,
        quantization=quantization,
        dtype=workload.dtype,
        max_num_seqs=max(workload.concurrency),  # no graphs captured for batches never run
    )
    dtype = str(llm.engine.dtype).removeprefix("torch.")
    graphs = llm.engine.runner.decode_graphs
    rng = random.Random(0)  # every backend gets the same prompts
    vocab = llm.engine.vocab_size
    # untimed runs compare tokens, and where they part, the first backend's top two logprobs there
    logprobs = None if workload.timed else 2
    params = SamplingParams(
        max_tokens=workload.output_len, temperature=0.0, ignore_eos=True, logprobs=logprobs
    )
    for n in workload.concurrency:
        if clock.past_deadline():
            yield {"backend": backend, "concurrency": n, "skipped": BUDGET_SPENT}
            continue
        prompts = [[rng.randrange(vocab) for _ in range(workload.prompt_len)] for _ in range(2 * n)]
        if workload.timed:  # other prompts: the prefix cache must not hold the measured ones
            llm.generate(prompts[n:], SamplingParams(max_tokens=2, ignore_eos=True))
        start = time.perf_counter()
        outputs = llm.generate(prompts[:n], params)  # the tokens reach the host: no sync needed
        seconds = time.perf_counter() - start
        runs = [out.outputs[0] for out in outputs]
        first = first_runs.setdefault(n, runs)
        same = sum(
            a == b
            for got, want in zip(runs, first, strict=True)
            for a, b in zip(got.token_ids, want.token_ids, strict=True)
        )
        total = sum(len(run.token_ids) for run in runs)
        row = {
            "backend": backend,
            "quantization": quantization,
            "dtype": dtype,
            "cuda_graphs": graphs is not None,
            "engine_start_s": round(clock.last_build_s, 1),
            "concurrency": n,
            "prompt_len": workload.prompt_len,
            "output_len": workload.output_len,
            "output_tokens": total,
            "seconds": round(seconds, 2),
            "output_tok_s": round(total / seconds, 1),
            "tokens_matching_first_backend": round(same / total, 3),
        }
        if not workload.timed:
            margins = [parting_margin(want, got) for got, want in zip(runs, first, strict=True)]
            parted = [m for m in margins if m is not None]
            row |= {
                "judged": dtype == JUDGED_DTYPE and quantization in ("auto", "none"),
                "sequences_parted": len(parted),
                "parted_at_near_ties": sum(m <= NEAR_TIE_NATS for m in parted),
                "widest_parting_nats": round(max(parted), 3) if parted else None,
            }
        print(json.dumps(row), file=sys.stderr, flush=True)
        yield row


def adapter_throughput(args: argparse.Namespace, clock: EngineClock) -> Iterator[dict]:
    """Output tok/s of args.lora_streams requests on the base model, then of the same prompts spread evenly over
    args.lora_adapters random adapters (bench/lora/adapters.py's: rank 16 on q/k/v/o, shaped by the model's
    config.json), in one Triton engine: the base batch decodes in CUDA graphs, steps with adapter rows eagerly
    through the Triton LoRA kernels. Each batch is warmed up on other prompts, which also loads every adapter."""
    from bench.lora.adapters import DEFAULT_RANK, make_adapters

    if not clock.has_room():
        yield {"backend": "triton", "skipped": BUDGET_SPENT}
        return
    with tempfile.TemporaryDirectory() as folder:  # the engine reads each adapter at its first request
        names = list(make_adapters(Path(folder), args.lora_adapters, args.model))
        llm = clock.build(
            args.model,
            device=args.device,
            attention_backend="triton",
            kv_cache_memory=args.kv_cache_memory,
            enable_lora=True,
            lora_modules={name: f"{folder}/{name}" for name in names},
            max_loras=len(names),
            max_num_seqs=args.lora_streams,
        )
        try:
            base = None
            for adapters in (0, len(names)):
                if clock.past_deadline():
                    yield {"backend": "triton", "adapters": adapters, "skipped": BUDGET_SPENT}
                    continue
                loras = [names[i % adapters] if adapters else None for i in range(args.lora_streams)]
                row = _adapter_batch(args, llm, loras) | {"adapters": adapters, "rank": DEFAULT_RANK}
                base = row["output_tok_s"] if adapters == 0 else base
                row["of_base"] = round(row["output_tok_s"] / base, 3) if adapters and base else None
                row["engine_start_s"] = round(clock.last_build_s, 1)
                print(json.dumps(row), file=sys.stderr, flush=True)
                yield row
        finally:
            llm.engine.close()
            del llm
            _free_device_memory(args.device)


def _adapter_batch(args: argparse.Namespace, llm, loras: list[str | None]) -> dict:
    """One timed batch, a request under each of loras (None: the base model), after a warm-up on other prompts."""
    from executor import SamplingParams

    n, rng, vocab = len(loras), random.Random(0), llm.engine.vocab_size  # the same prompts for each batch
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(2 * n)]
    llm.generate(prompts[n:], SamplingParams(max_tokens=2, ignore_eos=True), lora=loras)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts[:n], params, lora=loras)
    seconds = time.perf_counter() - start
    total = sum(len(out.outputs[0].token_ids) for out in outputs)
    return {
        "backend": "triton",
        "dtype": str(llm.engine.dtype).removeprefix("torch."),
        "cuda_graphs": all(lora is None for lora in loras) and llm.engine.runner.decode_graphs is not None,
        "concurrency": n,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "output_tokens": total,
        "seconds": round(seconds, 2),
        "output_tok_s": round(total / seconds, 1),
    }


def parting_margin(first, other) -> float | None:
    """Where other's greedy tokens first differ from first's: first's top-2 logprob margin there (in nats), or
    inf where other's token was not among first's top two; None where they never differ."""
    for position, (a, b) in enumerate(zip(first.token_ids, other.token_ids, strict=True)):
        if a != b:
            top = first.logprobs[position].top
            if b not in (token for token, _ in top[:2]):
                return float("inf")
            return top[0][1] - top[1][1]
    return None


def profiled_start(args: argparse.Namespace, clock: EngineClock) -> Iterator[dict]:
    """One engine with the serving defaults and no kv_cache_memory, then a few requests through it, for each of
    args.profiling_quantizations: quantized weights leave the KV cache more of the device."""
    if args.device != "cuda":
        yield {"skipped": "needs CUDA"}  # elsewhere the pool is a fixed default: nothing is profiled
        return
    for quantization in args.profiling_quantizations:
        if not clock.has_room():
            yield {"quantization": quantization, "skipped": BUDGET_SPENT}
            continue
        try:
            row = _profiled_row(args, clock, quantization)
        except Exception as error:
            traceback.print_exc()
            row = {"quantization": quantization, "error": repr(error), "traceback": traceback.format_exc()}
        _free_device_memory(args.device)  # the engine went with _profiled_row's frame
        yield row


def _profiled_row(args: argparse.Namespace, clock: EngineClock, quantization: str) -> dict:
    from executor import SamplingParams, weight_bytes

    with _engine_log_lines() as lines:
        llm = clock.build(args.model, device="cuda", quantization=quantization)
    n = max(args.e2e_concurrency)
    prompts = [[7 + i] * args.e2e_prompt_len for i in range(n)]
    params = SamplingParams(max_tokens=args.e2e_output_len, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    return {
        "backend": llm.engine.kernels.name,
        "quantization": quantization,
        "cuda_graphs": llm.engine.runner.decode_graphs is not None,
        "engine_start_s": round(clock.last_build_s, 1),
        "weight_bytes": weight_bytes(llm.engine.runner.model),
        "kv_blocks": llm.stats().kv_blocks_total,
        "block_size": llm.engine.block_size,
        "profiling_log": next((line for line in lines if line.startswith("profiling:")), None),
        "kv_cache_log": next((line for line in lines if line.startswith("KV cache:")), None),
        "output_tokens": sum(len(out.outputs[0].token_ids) for out in outputs),
    }


@contextmanager
def _engine_log_lines() -> Iterator[list[str]]:
    """The engine's INFO lines while the block runs, whatever logging is configured."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("kvserve.engine")
    handler, level = Collect(logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _free_device_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
