"""Where an engine step's time goes, on GuideLLM's chat shape, offline: N streams in a closed loop (a request
ends, the next one starts), prompts of 256 +- 64 tokens, 128 +- 32 output tokens, temperature 1.

    python -m bench.offline.step_profile [--streams 16] [--seconds 60] [--json out.json] [engine flags as keywords]

Each phase is timed around the engine's own parts (this benchmark reaches into them, which a user never does):
scheduling, building the batch, the model's forward pass (attention included), the LM head, sampling, and the
rest of the step (appending tokens, stop checks, caching full blocks, finishing requests). Steps that carry
prefill chunks and steps of decodes alone are reported apart.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import time
from collections import defaultdict

import torch

from bench.offline.workload import token_pool
from executor import LLM, SamplingParams

PHASES = ("schedule", "prepare", "forward", "lm_head", "sample")


class PhaseTimer:
    """Wraps an object's methods so their time adds up per phase for the step under way."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.returned: dict[str, object] = {}  # what each phase last returned

    def wrap(self, obj, method: str, phase: str) -> None:
        inner = getattr(obj, method)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                self.returned[phase] = result = inner(*args, **kwargs)
                return result
            finally:
                self.current[phase] += time.perf_counter() - start

        setattr(obj, method, timed)


def _sample_length(rng: random.Random, mean: int, stdev: int, low: int) -> int:
    return max(low, round(rng.gauss(mean, stdev)))


def run(args: argparse.Namespace, engine_args: dict) -> dict:
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, **engine_args)
    engine = llm.engine
    timer = PhaseTimer()
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.runner, "_prepare", "prepare")
    timer.wrap(engine.runner.model, "forward", "forward")
    timer.wrap(engine.runner.model, "compute_logits", "lm_head")
    timer.wrap(engine.sampling, "_sample", "sample")
    rng = random.Random(args.seed)
    pool = token_pool(llm.tokenizer, 4096)
    ids = itertools.count()

    def submit() -> None:
        prompt_len = _sample_length(rng, args.prompt_tokens, args.prompt_stdev, 32)
        start = rng.randrange(0, len(pool) - prompt_len)
        output_len = _sample_length(rng, args.output_tokens, args.output_stdev, 16)
        params = SamplingParams(max_tokens=output_len, temperature=args.temperature, ignore_eos=True)
        # a different first token per request, so that prompts share no prefix-cache blocks (as GuideLLM's)
        prompt = [rng.randrange(1000, 40000), *pool[start : start + prompt_len - 1]]
        engine.add_request(f"r{next(ids)}", prompt, params)

    wave_start = time.perf_counter()
    for _ in range(args.streams):
        submit()
    first_wave = set(engine.intake.requests)
    wave_ttft: dict[str, float] = {}  # the first wave's times to first token: they all arrive at once
    steps: dict[str, list[dict[str, float]]] = {"decode": [], "prefill": []}
    output_tokens, began, warm = 0, None, False
    while True:
        timer.current.clear()
        start = time.perf_counter()
        outputs = engine.step().outputs
        total = time.perf_counter() - start
        for out in outputs:
            if out.request_id in first_wave and out.new_token_ids:
                wave_ttft.setdefault(out.request_id, time.perf_counter() - wave_start)
        if not warm:  # the first wave's prefill is its own thing: start the clock once everyone decodes
            warm = all(r.num_computed_tokens >= r.num_prompt_tokens for r in engine.intake.requests.values())
            if warm:
                began = time.perf_counter()
        else:
            scheduled = timer.returned["schedule"].scheduled
            kind = "prefill" if any(n > 1 + len(r.spec_token_ids) for r, n in scheduled) else "decode"
            row = {phase: timer.current[phase] for phase in PHASES}
            row["other"] = total - sum(row.values())
            row["total"] = total
            steps[kind].append(row)
            output_tokens += sum(len(out.new_token_ids) for out in outputs)
        for out in outputs:
            if out.finish_reason is not None:
                submit()
        if began is not None and time.perf_counter() - began >= args.seconds:
            break
    elapsed = time.perf_counter() - began
    ttfts = sorted(wave_ttft.values())
    result = {
        "streams": args.streams,
        "seconds": elapsed,
        "output_tok_s": output_tokens / elapsed,
        "first_wave_ttft_s": {"first": ttfts[0], "median": ttfts[len(ttfts) // 2], "last": ttfts[-1]},
    }
    for kind, rows in steps.items():
        if rows:
            result[kind] = {
                "steps": len(rows),
                **{k: 1e3 * sum(r[k] for r in rows) / len(rows) for k in (*PHASES, "other", "total")},
            }
    return result


def format_result(result: dict) -> str:
    wave = result["first_wave_ttft_s"]
    lines = [
        f"{result['streams']} streams: {result['output_tok_s']:.1f} output tok/s over {result['seconds']:.0f} s "
        f"(after the first wave, whose first tokens came at {wave['first']:.1f} / {wave['median']:.1f} / "
        f"{wave['last']:.1f} s: first / median / last)"
    ]
    lines.append("| steps | count | " + " | ".join(PHASES) + " | other | total |")
    lines.append("|---" * (len(PHASES) + 4) + "|")
    for kind in ("decode", "prefill"):
        if kind in result:
            r = result[kind]
            cells = " | ".join(f"{r[p]:.1f}" for p in (*PHASES, "other", "total"))
            lines.append(f"| {kind} | {r['steps']} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--prompt-stdev", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--output-stdev", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the result here too")
    parser.add_argument(
        "engine", nargs="*", help="engine flags as key=value, e.g. max_num_batched_tokens=512"
    )
    args = parser.parse_args(argv)
    engine_args = {"max_model_len": 2048, "kv_cache_memory": "2GiB"}
    for item in args.engine:
        key, _, value = item.partition("=")
        engine_args[key] = int(value) if value.lstrip("-").isdigit() else value
    result = run(args, engine_args)
    print(format_result(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
