"""What per-request sampling state costs each engine step, offline: 16 requests decoding together, plain, each
with a logit_bias entry for every token of the vocabulary, one such request among 15 plain ones (what a
victim tenant sees), and with repetition_penalty on ~1k-token prompts.

    python -m bench.offline.sampling_cost [--requests 16] [--steps 32] [--json out.json] [engine flags as keywords]

Times whole decode steps (engine.step) and the sampling part of them (engine.sampling._sample, which this benchmark
reaches into), after every request has its prompt prefilled; median and mean over --steps steps. Prompts share
all but their last block, and one request is prefilled before the others join, so the prefix cache makes the
1k-token prefills cheap: prefill is not what is measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.offline.workload import token_pool
from executor import LLM, SamplingParams


def _scenarios(vocab_size: int, short: int, long: int) -> dict[str, tuple[int, list[dict]]]:
    """name -> (prompt tokens, per-request SamplingParams keywords for request 0, 1, ...)."""
    # small distinct values: every entry is real work, and the text stays much as without it
    full_bias = {token: (token % 7 - 3) / 100 for token in range(vocab_size)}
    return {
        "plain": (short, [{}]),
        "logit_bias_all": (short, [{"logit_bias": full_bias}]),
        "logit_bias_one": (short, [{"logit_bias": full_bias}, *[{}] * 15]),
        "plain_1k": (long, [{}]),
        "repetition_1k": (long, [{"repetition_penalty": 1.1}]),
        "penalties_1k": (
            long,
            [{"repetition_penalty": 1.1, "frequency_penalty": 0.2, "presence_penalty": 0.2}],
        ),
    }


def _params(extra: dict, steps: int) -> SamplingParams:
    return SamplingParams(max_tokens=steps + 8, temperature=1.0, seed=0, ignore_eos=True, **extra)


def run_scenario(llm: LLM, name: str, prompt_tokens: int, extras: list[dict], args) -> dict:
    engine = llm.engine
    pool = token_pool(llm.tokenizer, prompt_tokens + 64)
    prompts = [pool[: prompt_tokens - 1] + [1000 + i] for i in range(args.requests)]
    extras = [extras[i % len(extras)] for i in range(args.requests)]
    engine.add_request(f"{name}-0", prompts[0], _params(extras[0], args.steps))
    while engine.intake.requests[f"{name}-0"].num_output_tokens == 0:  # its blocks cached for the others
        engine.step()
    for i in range(1, args.requests):
        engine.add_request(f"{name}-{i}", prompts[i], _params(extras[i], args.steps))
    while any(r.num_output_tokens == 0 for r in engine.intake.requests.values()):
        engine.step()
    inner = engine.sampling._sample
    sample_seconds = []

    def timed(step):
        start = time.perf_counter()
        try:
            return inner(step)
        finally:
            sample_seconds.append(time.perf_counter() - start)

    engine.sampling._sample = timed
    step_seconds = []
    try:
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            step_seconds.append(time.perf_counter() - start)
    finally:
        del engine.sampling._sample  # back to the class's method
    while engine.has_unfinished():
        engine.step()

    def summary(seconds: list[float]) -> dict[str, float]:
        return {"median_ms": 1e3 * statistics.median(seconds), "mean_ms": 1e3 * statistics.fmean(seconds)}

    return {"prompt_tokens": prompt_tokens, "step": summary(step_seconds), "sample": summary(sample_seconds)}


def format_results(results: dict[str, dict], requests: int) -> str:
    lines = [
        f"{requests} requests decoding, ms per step (median / mean)",
        "| scenario | prompt tokens | step | of which sampling |",
        "|---|---|---|---|",
    ]
    for name, r in results.items():
        step, sample = r["step"], r["sample"]
        lines.append(
            f"| {name} | {r['prompt_tokens']} | {step['median_ms']:.1f} / {step['mean_ms']:.1f} | "
            f"{sample['median_ms']:.1f} / {sample['mean_ms']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--short-prompt", type=int, default=128)
    parser.add_argument("--long-prompt", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", nargs="*", default=None, help="run only these scenarios")
    parser.add_argument("--json", default=None, help="write the result here too")
    parser.add_argument("engine", nargs="*", help="engine flags as key=value, e.g. device=cuda")
    args = parser.parse_args(argv)
    engine_args = {"max_model_len": 2048, "kv_cache_memory": "2GiB"}
    for item in args.engine:
        key, _, value = item.partition("=")
        engine_args[key] = int(value) if value.lstrip("-").isdigit() else value
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, **engine_args)
    scenarios = _scenarios(llm.engine.vocab_size, args.short_prompt, args.long_prompt)
    run_scenario(llm, "warm-up", args.short_prompt, [{}], args)  # first steps pay one-off costs
    results = {}
    for name, (prompt_tokens, extras) in scenarios.items():
        if args.only is None or name in args.only:
            results[name] = run_scenario(llm, name, prompt_tokens, extras, args)
            print(name, json.dumps(results[name]), flush=True)
    print(format_results(results, args.requests))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
