"""Quantized weights side by side, in one run: output tokens per second at one stream and at 16 (closed loop,
128 output tokens each, EOS ignored, temperature 0, the chat prompt of PEERS.md) for

- kvserve float32, int8, Q8_0 GGUF and Q4_1 GGUF (bench/quantized_models.py), each as `kvserve up`;
- llama.cpp's `llama-server` on the same two GGUF files, with --llama-server PATH (built outside the repository,
  as ../shared/PEERS.md says; run as PEERS.md runs it);
- HF transformers `generate`, float32, at one stream (bench/throughput.py's runner, no HTTP);

with the memory of each one's weights: kvserve's as its executor logs them (quantized at their own size), the
GGUF file's size for llama-server (it maps the file as it is), the parameters' bytes for HF. With --guidellm,
also GuideLLM chat at 16 streams against kvserve int8 and vLLM's CPU build float32 (bench/guidellm.py's runner).

    python -m bench.quantization [--variants float32,int8,q8_0,q4_1] [--streams 1,16] [--max-tokens 128]
                                 [--requests-per-stream 4] [--llama-server PATH] [--no-hf] [--guidellm]
                                 [--port 8350] [--out bench/results/quantization]

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
from argparse import Namespace
from dataclasses import asdict
from pathlib import Path

from bench import guidellm
from bench.load import LoadConfig, run_load
from bench.metrics import summarize
from bench.prompts import FixedPrompt
from bench.quantized_models import GGUF_FILES, VARIANTS, variant_model

PROMPT = "Write a short story about a robot."
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


def serve(label: str, command: list[str], env: dict[str, str], args: Namespace) -> tuple[dict, str]:
    """Start a server, measure it, stop it; its rates (empty if it never served: its log says why) and its
    log."""
    log_path = args.out / f"{label}.server.log"
    print(f"starting {label}: {' '.join(command)}", flush=True)
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        rates = {}
        try:
            guidellm.wait_ready(f"http://127.0.0.1:{args.port}", process)
            rates = measure_streams(f"http://127.0.0.1:{args.port}", args.streams, args)
        except RuntimeError as error:  # it exited or never served: the other systems still run
            print(f"  {label}: {error}; see {log_path}", flush=True)
        finally:
            guidellm.stop(process)
    return rates, log_path.read_text()


def run_kvserve(name: str, args: Namespace) -> dict:
    model, quantization = variant_model(name)
    extra = ["--model", model, "--quantization", quantization, "--served-model-name", guidellm.MODEL_NAME]
    command, env = guidellm.server_command("kvserve", args.peers, model, args.port, extra)
    rates, log = serve(f"kvserve-{name}", command, env, args)
    logged = WEIGHTS_LOGGED.findall(log)
    return {
        "system": f"kvserve {name}",
        "weight_mib": float(logged[-1]) if logged else None,
        "streams": rates,
    }


def run_llama_server(name: str, args: Namespace) -> dict:
    gguf = GGUF_FILES[name]()
    command = [str(args.llama_server), "-m", str(gguf), "-np", "32", "-kvu", "-c", "8192", "-t", "2",
               "--host", "127.0.0.1", "--port", str(args.port)]  # fmt: skip
    rates, _ = serve(f"llama-server-{name}", command, dict(os.environ), args)
    return {"system": f"llama-server {name}", "weight_mib": gguf.stat().st_size / 2**20, "streams": rates}


def run_hf_generate(args: Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.throughput import run_hf
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
            cells.append(
                "—"
                if rate is None
                else f"{rate['output_tok_s']:.1f}" + (f" ({rate['failed']} failed)" if rate["failed"] else "")
            )
        weight = "—" if r["weight_mib"] is None else f"{r['weight_mib']:.0f}"
        lines.append(f"| {r['system']} | {' | '.join(cells)} | {weight} |")
    return f"{max_tokens} output tokens per request, temperature 0, EOS ignored\n\n" + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated: {', '.join(VARIANTS)}"
    )
    parser.add_argument("--streams", default="1,16", help="comma-separated concurrency levels")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests-per-stream", type=int, default=4, help="requests each client sends")
    parser.add_argument("--llama-server", type=Path, default=None, help="llama.cpp's llama-server binary")
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
    variants = [v for v in args.variants.split(",") if v]
    if unknown := [v for v in variants if v not in VARIANTS]:
        parser.error(f"--variants: unknown variant {unknown[0]!r} ({', '.join(VARIANTS)})")
    args.streams = [int(s) for s in args.streams.split(",") if s]
    if not args.streams or min(args.streams) < 1 or args.max_tokens < 1 or args.requests_per_stream < 1:
        parser.error("--streams, --max-tokens and --requests-per-stream must be at least 1")
    if args.llama_server is not None and not os.access(args.llama_server, os.X_OK):
        parser.error(f"--llama-server: {args.llama_server} is not an executable file")
    args.out.mkdir(parents=True, exist_ok=True)

    results = [run_kvserve(name, args) for name in variants]
    if args.llama_server is not None:
        results += [run_llama_server(name, args) for name in variants if name in GGUF_FILES]
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
