"""Parallel sampling: KV blocks and output throughput of one n = 8 request against eight n = 1 requests.

    python -m bench.offline.parallel_sampling [--prompt-tokens 1000] [--n 8] [--max-tokens 64] [--output FILE.json]

The same ~1,000-token prompt four ways, on the default model in float32: one request with n = 8, and eight n = 1
requests added together, each with the prefix cache on and off. For each it reports the KV blocks in use at the
peak (the engine's own count after every step), against one prompt plus eight outputs (the prompt's full blocks
once, then each choice's own blocks), and output tokens per second over the whole run (prefill included), so
the n = 8 request's one prefill shows in its throughput.
"""

from __future__ import annotations

import argparse
import json
import time

from executor import LLM, SamplingParams

BLOCK_SIZE = 16


def make_prompt(llm: LLM, num_tokens: int) -> list[int]:
    """A prose prompt cut to num_tokens tokens, so every case sees the very same ids."""
    text = " ".join(
        f"Paragraph {i}: the paged cache keeps each sequence in fixed-size blocks." for i in range(400)
    )
    return llm.tokenizer.encode(text)[:num_tokens]


def ideal_blocks(prompt_tokens: int, n: int, max_tokens: int) -> int:
    """One prompt + n outputs: the prompt's full blocks once, then each choice's partial block and outputs."""
    shared = prompt_tokens // BLOCK_SIZE
    return shared + n * (-(-(prompt_tokens + max_tokens) // BLOCK_SIZE) - shared)


def run_case(llm: LLM, prompt: list[int], n: int, max_tokens: int, grouped: bool) -> dict:
    """grouped: one request with n choices; else n requests of one choice each, added in one go."""
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=0, ignore_eos=True)
    if grouped:
        ids = [llm.add_request(prompt, SamplingParams(**{**_fields(params), "n": n}))]
    else:
        ids = [llm.add_request(prompt, SamplingParams(**{**_fields(params), "seed": i})) for i in range(n)]
    pending, peak, output_tokens, steps = set(ids), 0, 0, 0
    started, cpu_started = time.perf_counter(), time.process_time()
    while pending:
        for out in llm.step():
            if out.finished and out.request_id in pending:
                pending.discard(out.request_id)
                output_tokens += sum(len(c.token_ids) for c in out.outputs)
        steps += 1
        peak = max(peak, llm.stats().kv_blocks_used)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    return {
        "peak_kv_blocks": peak,
        "output_tokens": output_tokens,
        "seconds": round(seconds, 2),
        "output_tok_per_s": round(output_tokens / seconds, 1),
        # on a machine shared with other work, wall time swings with their load; CPU time much less
        "cpu_seconds": round(cpu_seconds, 2),
        "output_tok_per_cpu_s": round(output_tokens / cpu_seconds, 1),
        "steps": steps,
    }


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__slots__}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--output", help="also write the results here as JSON")
    args = parser.parse_args()
    results = []
    for caching in (True, False):
        for grouped in (True, False):
            # an engine of its own per case: a cold prefix cache, no hits from the case before
            llm = LLM(
                args.model,
                dtype="float32",
                kv_cache_memory=args.kv_cache_memory,
                enable_prefix_caching=caching,
            )
            prompt = make_prompt(llm, args.prompt_tokens)
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up, off the clock
            result = run_case(llm, prompt, args.n, args.max_tokens, grouped)
            result |= {"case": f"1 x n={args.n}" if grouped else f"{args.n} x n=1", "prefix_caching": caching}
            results.append(result)
            print(json.dumps(result), flush=True)
    ideal = ideal_blocks(len(prompt), args.n, args.max_tokens)
    print(f"\nprompt {len(prompt)} tokens, n={args.n} x {args.max_tokens} output tokens, block {BLOCK_SIZE}")
    print(
        f"one prompt + {args.n} outputs = {ideal} blocks; {args.n} separate copies = "
        f"{args.n * -(-(len(prompt) + args.max_tokens) // BLOCK_SIZE)} blocks\n"
    )
    print(
        "| requests | prefix caching | peak KV blocks | vs one prompt + outputs | steps | output tok/s (wall) "
        "| output tok per CPU s |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['case']} | {'on' if r['prefix_caching'] else 'off'} | {r['peak_kv_blocks']} | "
            f"{r['peak_kv_blocks'] / ideal:.2f}x | {r['steps']} | {r['output_tok_per_s']} | "
            f"{r['output_tok_per_cpu_s']} |"
        )
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"ideal_blocks": ideal, "prompt_tokens": len(prompt), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
