"""LoRA adapters side by side (issue 50): one `kvserve up` serving --adapters random adapters beside the default
model, its output tok/s over base only and over 1, 4 and 8 adapters against base only (target >= 0.8x with 8),
TTFT and ITL p50, and each adapter's load time; with --vllm, vLLM's CPU build on the same adapters and prompts.

Adapters: bench/lora/adapters.py (random A and B, PEFT's files and key names; rank 16 on q, k, v and o by
default). Requests: bench/lora/workload.py (--streams closed-loop streams, --rounds requests each, every prompt its
own, ignore_eos, spread evenly over an arm's adapters; the load probe first, on the idle server). kvserve runs
with its default engine settings (the default model's GGUF blocks and int8 activations: the report quotes the
executor's line saying what it serves) and one key that owns every adapter, with a data directory of its own; its
executor at niceness 0, as bench/serving/guidellm.py runs it, since the load client shares the cores. vLLM runs in
float32 (what it serves on this CPU) with --enable-lora --max-loras and --max-cpu-loras the adapter count. One
server at a time; each one's log goes to --log-dir.

    python -m bench.lora [--out bench/results/lora.json]
    python -m bench.lora --vllm ~/peers/vllm/bin/python          # and vLLM's CPU build on the same adapters
    python -m bench.lora --streams 2 --rounds 1 --max-tokens 8 --adapters 2 --arms 0,1,2   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
import tempfile
from pathlib import Path

from bench.load import first_model
from bench.lora.adapters import add_adapter_args, make_adapters
from bench.lora.report import tables
from bench.lora.workload import ARM_ADAPTERS, Shape, Target, measure
from bench.serving.guidellm import MODEL_NAME, kvserve_env, stop, vllm_command, wait_ready
from bench.tenancy.tenant_stack import tenant_stack
from kvserve.redis_server import free_port
from shared.model_paths import pulled_model_dir

TENANT = "lora-bench"
# the executor's log lines saying how its weights are served: their format, and the CPU kernels' integer panels
SERVED_LINES = ("as served (--quantization", "quantized linear layers")
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM's --max-lora-rank accepts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.lora",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--adapters", type=int, default=8, help="adapters made and served")
    parser.add_argument(
        "--arms", type=_arms, default=ARM_ADAPTERS, help="adapters per arm, comma-separated; 0: base only"
    )
    parser.add_argument("--streams", type=_positive, default=16, help="concurrent streams")
    parser.add_argument("--rounds", type=_positive, default=3, help="requests per stream and arm")
    parser.add_argument("--prompt-tokens", type=_positive, default=128)
    parser.add_argument(
        "--max-tokens", type=_positive, default=128, help="every request's output (ignore_eos)"
    )
    add_adapter_args(parser)
    parser.add_argument(
        "--adapter-dir", type=Path, default=None, help="where adapters go (default: a temp dir)"
    )
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--up-args", default="", help="more `kvserve up` flags, as one string")
    parser.add_argument("--no-kvserve", action="store_true", help="only the peer (with --vllm)")
    parser.add_argument(
        "--vllm", type=Path, default=None, help="the python of a venv holding vLLM's CPU build"
    )
    parser.add_argument("--vllm-args", default="", help="more vLLM server flags, as one string")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", type=Path, default=Path("bench/results"), help="the servers' output")
    parser.add_argument("--out", type=Path, default=Path("bench/results/lora.json"))
    return parser


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _arms(text: str) -> tuple[int, ...]:
    try:
        arms = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"adapter counts separated by commas, got {text!r}") from None
    if not arms or min(arms) < 0:
        raise argparse.ArgumentTypeError(f"adapter counts of 0 or more, got {text!r}")
    return tuple(dict.fromkeys(arms))


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments together, or None."""
    if max(args.arms) > args.adapters:
        return f"--arms {max(args.arms)} needs at least that many --adapters (got {args.adapters})"
    if 0 not in args.arms:
        return "--arms must include 0 (base only): every ratio is against it"
    if args.no_kvserve and args.vllm is None:
        return "--no-kvserve leaves nothing to run without --vllm"
    if args.vllm is not None and not args.vllm.is_file():
        return f"--vllm {args.vllm}: no such file (give the python of vLLM's virtual environment)"
    return None


def served_quantization(log: Path) -> str | None:
    """What the executor's log says of how its weights are served (None: it says nothing)."""
    found = [
        line.split(": ", 1)[-1].strip()
        for line in log.read_text(errors="replace").splitlines()
        if any(marker in line for marker in SERVED_LINES)
    ]
    return "; ".join(found) or None


def run_kvserve(args: argparse.Namespace, paths: dict[str, Path], shape: Shape) -> dict:
    names = list(paths)
    flags = ["--enable-lora", "--lora-modules", *(f"{n}={p}" for n, p in paths.items())]
    flags += [
        "--max-loras",
        str(len(names)),
        "--max-cpu-loras",
        str(len(names)),
        "--max-lora-rank",
        str(args.rank),
    ]
    flags += ["--executor-niceness", "0", *shlex.split(args.up_args)]
    log = args.log_dir / "lora_kvserve.log"
    print(f"kvserve up {' '.join(flags)}", flush=True)
    with tenant_stack([TENANT], log, args.model, flags, key_args=["--adapters", ",".join(names)]) as stack:
        key = stack.keys[TENANT]
        target = Target(stack.url, key, asyncio.run(first_model(stack.url, key)))
        report = asyncio.run(measure(target, names, shape, args.arms, args.seed))
    return {"flags": flags, "quantization": served_quantization(log), **report}


def vllm_lora_flags(paths: dict[str, Path], rank: int) -> list[str]:
    max_rank = next((r for r in VLLM_RANKS if r >= rank), rank)
    flags = ["--enable-lora", "--lora-modules", *(f"{n}={p}" for n, p in paths.items())]
    return flags + [
        "--max-loras",
        str(len(paths)),
        "--max-cpu-loras",
        str(len(paths)),
        "--max-lora-rank",
        str(max_rank),
    ]


def run_vllm(args: argparse.Namespace, paths: dict[str, Path], shape: Shape) -> dict:
    port = free_port()
    command, env = vllm_command(args.vllm, str(pulled_model_dir(args.model)), port)
    command += vllm_lora_flags(paths, args.rank) + shlex.split(args.vllm_args)
    url = f"http://127.0.0.1:{port}"
    print(" ".join(command), flush=True)
    with open(args.log_dir / "lora_vllm.log", "wb") as log:
        process = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_ready(url, process)
        report = asyncio.run(measure(Target(url, None, MODEL_NAME), list(paths), shape, args.arms, args.seed))
    finally:
        stop(process)
    return {"command": command, "quantization": "none (float32)", **report}


def _stop_on_sigterm(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through the servers' cleanup, as Ctrl-C does


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if problem := check_args(args):
        parser.error(problem)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    os.environ.update(kvserve_env())  # a throwaway KVSERVE_HOME for `kvserve up` and `kvserve keys`
    args.log_dir.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    adapter_dir = args.adapter_dir or Path(tempfile.mkdtemp(prefix="kvserve-lora-"))
    paths = make_adapters(adapter_dir, args.adapters, args.model, args.rank, args.target_modules, args.seed)
    shape = Shape(args.streams, args.rounds, args.prompt_tokens, args.max_tokens)
    results: dict = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "adapters": {n: str(p) for n, p in paths.items()},
    }
    systems: dict[str, dict] = {}
    runs = ([] if args.no_kvserve else [("kvserve", run_kvserve)]) + (
        [("vLLM CPU", run_vllm)] if args.vllm else []
    )
    for name, run in runs:
        systems[name] = run(args, paths, shape)
        results["systems"] = systems
        results["table"] = tables(systems)
        args.out.write_text(json.dumps(results, indent=1))  # each system kept as soon as it is measured
        print(tables({name: systems[name]}), flush=True)
    for name, report in systems.items():
        print(f"{name} weights: {report['quantization']}")
    print()
    print(results["table"])
    print(f"\nresults: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
