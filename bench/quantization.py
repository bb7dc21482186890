"""Quantized weights side by side, in one run: output tokens per second at one stream and at 16 (closed loop,
128 output tokens each, EOS ignored, temperature 0, one short chat prompt: PROMPT below) for

- kvserve float32, int8, Q8_0 GGUF and Q4_1 GGUF (bench/quantized_models.py), each as `kvserve up`, with its
  default activations or as VARIANT:ACTIVATIONS (--quantized-activations, e.g. q4_1:int16);
- llama.cpp's `llama-server` on the same two GGUF files, with --llama-server PATH (built outside the repository:
  docs/benchmarks.md, Peers). Both servers of a file are up at once and measured in
  --rounds alternating rounds, each first in every other: the median round of each, and the median of kvserve's
  ratios round by round;
- HF transformers `generate`, float32, at one stream (bench/offline/throughput.py's runner, no HTTP);

with the memory of each one's weights: kvserve's as its executor logs them (quantized at their own size), the
GGUF file's size for llama-server (it maps the file as it is), the parameters' bytes for HF. With --guidellm,
also GuideLLM chat at 16 streams against kvserve int8 and vLLM's CPU build float32 (bench/serving/guidellm.py's runner).

    python -m bench.quantization [--variants float32,int8,q8_0,q4_1] [--streams 1,16] [--max-tokens 128]
                                 [--requests-per-stream 4] [--llama-server PATH] [--rounds 3] [--no-hf]
                                 [--guidellm] [--port 8350] [--out bench/results/quantization]

Writes summary.json and summary.md under --out, and each server's log beside them. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from argparse import Namespace
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from bench.load import LoadConfig, run_load
from bench.metrics import summarize
from bench.prompts import FixedPrompt
from bench.quantized_models import GGUF_FILES, VARIANTS, split_variant, variant_list, variant_model
from bench.serving import guidellm

PROMPT = "Write a short story about a robot."
SETTLE_S = 2.0
WEIGHTS_LOGGED = re.compile(r"weights: ([\d.]+) MiB")


def measure_streams(url: str, streams: list[int], args: Namespace) -> dict[str, dict]:
    """streams -> output tok/s over N clients back to back, each sending --requests-per-stream requests."""
    rates = {}
    for count in streams:
        config = LoadConfig(
            url=url,
            model=guidellm.MODEL_NAME,
            concurrency=count,
            num_requests=count * args.requests_per_stream,
            max_tokens=args.max_tokens,
            temperature=0.0,
            ignore_eos=True,
        )
        results, duration = asyncio.run(run_load(config, FixedPrompt(PROMPT)))
        summary = summarize(results, duration)
        rates[str(count)] = {
            "output_tok_s": summary["output_tokens_per_s"],
            "tpot_p50_ms": summary["tpot_ms"]["p50"],
            "completed": summary["completed"],
            "failed": summary["failed"],
        }
        print(f"  {count} streams: {summary['output_tokens_per_s']:.1f} output tok/s", flush=True)
    return rates


@contextmanager
def started(label: str, command: list[str], env: dict[str, str], port: int, args: Namespace):
    """A server up for the block: its URL, or None where it never served (its log, under --out, says why)."""
    log_path = args.out / f"{label}.server.log"
    print(f"starting {label}: {' '.join(command)}", flush=True)
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            url = f"http://127.0.0.1:{port}"
            try:
                guidellm.wait_ready(url, process)
            except RuntimeError as error:  # it exited or never served: the other systems still run
                print(f"  {label}: {error}; see {log_path}", flush=True)
                url = None
            yield url
        finally:
            guidellm.stop(process)


def kvserve_server(name: str, port: int, args: Namespace) -> tuple[str, list[str], dict[str, str]]:
    base, activations = split_variant(name)
    model, quantization = variant_model(base)
    extra = ["--model", model, "--quantization", quantization, "--served-model-name", guidellm.MODEL_NAME]
    if activations is not None:
        extra += ["--quantized-activations", activations]
    command, env = guidellm.server_command("kvserve", args.peers, model, port, extra)
    return f"kvserve-{name}", command, env


def llama_server(name: str, port: int, args: Namespace) -> tuple[str, list[str], dict[str, str]]:
    command = [str(args.llama_server), "-m", str(GGUF_FILES[name]()), "-np", "32", "-kvu", "-c", "8192",
               "-t", "2", "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    return f"llama-server-{name}", command, dict(os.environ)


def kvserve_row(name: str, label: str, rates: dict, args: Namespace) -> dict:
    logged = WEIGHTS_LOGGED.findall((args.out / f"{label}.server.log").read_text())
    return {
        "system": f"kvserve {name}",
        "weight_mib": float(logged[-1]) if logged else None,
        "streams": rates,
    }


def llama_row(name: str, rates: dict) -> dict:
    size = GGUF_FILES[name]().stat().st_size
    return {"system": f"llama-server {name}", "weight_mib": size / 2**20, "streams": rates}


def run_kvserve(name: str, args: Namespace) -> dict:
    label, command, env = kvserve_server(name, args.port, args)
    with started(label, command, env, args.port, args) as url:
        rates = {} if url is None else measure_streams(url, args.streams, args)
    return kvserve_row(name, label, rates, args)


def median_rates(rounds: list[dict]) -> dict:
    """Per concurrency: the median round's rate and its tpot, all rounds' counts and rates."""
    merged = {}
    for count in rounds[0]:
        runs = [r[count] for r in rounds if count in r]
        middle = sorted(runs, key=lambda run: run["output_tok_s"])[len(runs) // 2]
        merged[count] = {
            "output_tok_s": middle["output_tok_s"],
            "tpot_p50_ms": middle["tpot_p50_ms"],
            "completed": sum(run["completed"] for run in runs),
            "failed": sum(run["failed"] for run in runs),
            "rounds": [run["output_tok_s"] for run in runs],
        }
    return merged


def run_pair(name: str, args: Namespace) -> list[dict]:
    """kvserve and llama-server on one GGUF file, both up at once and measured in --rounds alternating rounds
    (each goes first in every other): a decode at one stream is bound by memory bandwidth, which on a shared
    machine drifts by 15-30% within minutes, so measuring one system after the other measured that drift too."""
    kv_label, kv_command, kv_env = kvserve_server(name, args.port, args)
    ll_label, ll_command, ll_env = llama_server(name, args.port + 1, args)
    rounds = {"kvserve": [], "llama": []}
    with (
        started(kv_label, kv_command, kv_env, args.port, args) as kv_url,
        started(ll_label, ll_command, ll_env, args.port + 1, args) as ll_url,
    ):
        systems = [("kvserve", kv_url), ("llama", ll_url)]
        for r in range(args.rounds):
            for system, url in systems if r % 2 == 0 else systems[::-1]:
                if url is not None:
                    # the other server's threads wind down first (llama.cpp's spin a while after a batch), so
                    # that neither starts its turn beside the other's leftovers
                    time.sleep(SETTLE_S)
                    print(f"round {r + 1}, {system} {name}", flush=True)
                    rounds[system].append(measure_streams(url, args.streams, args))
    kv_rates = median_rates(rounds["kvserve"]) if rounds["kvserve"] else {}
    ll_rates = median_rates(rounds["llama"]) if rounds["llama"] else {}
    for count, rate in kv_rates.items():
        if count in ll_rates:
            ratios = [k / v for k, v in zip(rate["rounds"], ll_rates[count]["rounds"], strict=True) if v > 0]
            rate["vs_llama_server"] = sorted(ratios)[len(ratios) // 2] if ratios else None
            rate["vs_llama_server_rounds"] = ratios
    return [kvserve_row(name, kv_label, kv_rates, args), llama_row(name, ll_rates)]


def run_hf_generate(args: Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.offline.throughput import run_hf
    from executor import resolve_model

    torch.set_num_threads(2)
    model_dir = str(resolve_model(None))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    print("HF generate, float32, one stream", flush=True)
    result = run_hf(model_dir, [prompt] * args.requests_per_stream, args.max_tokens, 1, "hf_generate")
    params = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).num_parameters()
    rate = {"output_tok_s": result["output_tok_s"], "completed": result["requests"], "failed": 0}
    print(f"  1 stream: {result['output_tok_s']:.1f} output tok/s", flush=True)
    return {"system": "hf_generate float32", "weight_mib": params * 4 / 2**20, "streams": {"1": rate}}


def run_guidellm(args: Namespace) -> list[guidellm.Row]:
    """GuideLLM chat at 16 streams: kvserve int8, then vLLM's CPU build float32."""
    binary = (
        guidellm.ensure_venv(args.peers, "guidellm", [f"guidellm=={guidellm.GUIDELLM_VERSION}"]) / "guidellm"
    )
    options = Namespace(
        port=args.port,
        peers=args.peers,
        kvserve_args="--quantization int8",
        out=args.out / "guidellm",
        workloads=["chat"],
        concurrency=[16],
        seconds=args.guidellm_seconds,
        seconds_single=args.guidellm_seconds,
    )
    options.out.mkdir(parents=True, exist_ok=True)
    model = guidellm.model_dir()
    return [
        row for system in ("kvserve", "vllm") for row in guidellm.run_system(system, options, model, binary)
    ]


def markdown(results: list[dict], streams: list[int], max_tokens: int) -> str:
    heads = " | ".join(f"tok/s at {s} stream{'s' if s > 1 else ''}" for s in streams)
    lines = [f"| system | {heads} | weights MiB |", "|---|" + "---|" * (len(streams) + 1)]
    for r in results:
        cells = []
        for s in streams:
            rate = r["streams"].get(str(s))
            if rate is None:
                cells.append("—")
                continue
            cell = f"{rate['output_tok_s']:.1f}"
            if rate.get("vs_llama_server") is not None:
                cell += f" ({rate['vs_llama_server']:.2f}x llama-server)"
            cells.append(cell + (f" ({rate['failed']} failed)" if rate["failed"] else ""))
        weight = "—" if r["weight_mib"] is None else f"{r['weight_mib']:.0f}"
        lines.append(f"| {r['system']} | {' | '.join(cells)} | {weight} |")
    note = (
        f"{max_tokens} output tokens per request, temperature 0, EOS ignored; a GGUF file's kvserve and"
        " llama-server rows: the median of alternating rounds, and kvserve's median ratio over the rounds"
    )
    return note + "\n\n" + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--variants",
        type=variant_list,
        default=",".join(VARIANTS),
        help=f"comma-separated: {', '.join(VARIANTS)}, each optionally :ACTIVATIONS (--quantized-activations)",
    )
    parser.add_argument("--streams", default="1,16", help="comma-separated concurrency levels")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests-per-stream", type=int, default=4, help="requests each client sends")
    parser.add_argument("--llama-server", type=Path, default=None, help="llama.cpp's llama-server binary")
    parser.add_argument(
        "--rounds", type=int, default=3, help="alternating rounds of kvserve and llama-server on a GGUF file"
    )
    parser.add_argument("--no-hf", action="store_true", help="skip HF generate")
    parser.add_argument(
        "--guidellm", action="store_true", help="GuideLLM chat, 16 streams: kvserve int8 vs vLLM"
    )
    parser.add_argument("--guidellm-seconds", type=float, default=180)
    parser.add_argument("--port", type=int, default=8350)
    default_peers = os.environ.get("KVSERVE_PEERS", str(Path.home() / ".cache" / "kvserve-peers"))
    parser.add_argument("--peers", type=Path, default=Path(default_peers), help="peers' virtual environments")
    parser.add_argument("--out", type=Path, default=Path("bench/results/quantization"))
    args = parser.parse_args(argv)
    variants = args.variants
    args.streams = [int(s) for s in args.streams.split(",") if s]
    if (
        not args.streams
        or min(args.streams) < 1
        or min(args.max_tokens, args.requests_per_stream, args.rounds) < 1
    ):
        parser.error("--streams, --max-tokens, --requests-per-stream and --rounds must be at least 1")
    if args.llama_server is not None and not os.access(args.llama_server, os.X_OK):
        parser.error(f"--llama-server: {args.llama_server} is not an executable file")
    args.out.mkdir(parents=True, exist_ok=True)

    paired = [name for name in variants if args.llama_server is not None and name in GGUF_FILES]
    results = [run_kvserve(name, args) for name in variants if name not in paired]
    for name in paired:
        results += run_pair(name, args)
    if not args.no_hf and 1 in args.streams:
        results.append(run_hf_generate(args))
    report = {"prompt": PROMPT, "max_tokens": args.max_tokens, "results": results}
    table = markdown(results, args.streams, args.max_tokens)
    if args.guidellm:
        rows = run_guidellm(args)
        report["guidellm"] = [asdict(row) for row in rows]
        table += "\nGuideLLM chat, 16 streams (kvserve with --quantization int8, vLLM float32):\n\n"
        table += guidellm.markdown(rows)
    (args.out / "summary.json").write_text(json.dumps(report, indent=1))
    (args.out / "summary.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
