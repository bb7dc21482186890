"""Prefix caching: 32 requests share a 1,024-token system prompt, each with its own 32-token question.

Requests arrive one after another (each once the previous has its first token), as users of one app would.
Reports the prefix-cache hit rate over the prompt tokens of requests 2..N and time to first token, on vs off.

python -m bench.offline.prefix_cache [--requests 32] [--shared 1024] [--question 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench.offline.workload import token_pool
from executor import LLM, SamplingParams, resolve_model


def time_to_first_token(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[float, int]:
    start = time.perf_counter()
    request_id = llm.add_request(prompt, params)
    ttft = None
    cached = 0
    while llm.engine.has_unfinished():
        for out in llm.step():
            if out.request_id == request_id and ttft is None:
                ttft = time.perf_counter() - start
                cached = out.num_cached_tokens
    return ttft, cached


def run(model_dir: str, prompts: list[list[int]], caching: bool) -> dict:
    llm = LLM(model_dir, kv_cache_memory="1GiB", enable_prefix_caching=caching)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ttfts, cached = [], []
    for prompt in prompts:
        ttft, hit = time_to_first_token(llm, prompt, params)
        ttfts.append(ttft)
        cached.append(hit)
    later_prompt_tokens = sum(len(p) for p in prompts[1:])
    return {
        "prefix_caching": caching,
        "first_ttft_s": ttfts[0],
        "later_mean_ttft_s": statistics.mean(ttfts[1:]),
        "later_hit_rate": sum(cached[1:]) / later_prompt_tokens,
        "stats_hit_rate": llm.stats().prefix_cache_hit_tokens
        / max(1, llm.stats().prefix_cache_queried_tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--shared", type=int, default=1024)
    parser.add_argument("--question", type=int, default=32)
    args = parser.parse_args()
    model_dir = str(resolve_model(args.model))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    system = token_pool(tokenizer, args.shared)
    filler = token_pool(tokenizer, args.question)
    questions = [
        (
            tokenizer.encode(f"\nQuestion {i}: in {i + 3} words, what does the text say about paging?")
            + filler
        )[: args.question]
        for i in range(args.requests)
    ]
    prompts = [system + q for q in questions]
    on = run(model_dir, prompts, caching=True)
    print(json.dumps(on), flush=True)
    off = run(model_dir, prompts, caching=False)
    print(json.dumps(off), flush=True)
    print(
        f"hit rate after the first request: {on['later_hit_rate']:.3f} of prompt tokens; mean TTFT "
        f"{1000 * on['later_mean_ttft_s']:.0f} ms with caching vs {1000 * off['later_mean_ttft_s']:.0f} ms without "
        f"({off['later_mean_ttft_s'] / on['later_mean_ttft_s']:.1f}x)"
    )


if __name__ == "__main__":
    main()
