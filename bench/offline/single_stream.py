"""One stream alone, offline: kvserve's LLM against HF transformers' generate on the same weights, the same
prompt, 128 output tokens sampled at temperature 1 (EOS ignored, so both emit all 128), rounds interleaved.

    python -m bench.offline.single_stream [--rounds 3] [--max-tokens 128] [--prompt-tokens 256]

Each system is timed from the request to its last token (prefill included), and the median of the rounds is
reported as output tokens per second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.offline.workload import token_pool
from executor import LLM, SamplingParams, resolve_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    model_dir = str(resolve_model(args.model))
    llm = LLM(model_dir, max_model_len=2048, kv_cache_memory="1GiB", enable_prefix_caching=False)
    prompt = token_pool(llm.tokenizer, args.prompt_tokens)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])

    def run_kvserve() -> float:
        start = time.perf_counter()
        out = llm.generate([prompt], params)[0].outputs[0]
        assert len(out.token_ids) == args.max_tokens
        return args.max_tokens / (time.perf_counter() - start)

    def run_hf() -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.max_tokens,
                min_new_tokens=args.max_tokens,
                pad_token_id=0,
            )
        assert out.shape[1] == len(prompt) + args.max_tokens
        return args.max_tokens / (time.perf_counter() - start)

    run_kvserve(), run_hf()  # warm-up, outside the rounds
    rates: dict[str, list[float]] = {"kvserve": [], "hf_generate": []}
    for _ in range(args.rounds):
        rates["kvserve"].append(run_kvserve())
        rates["hf_generate"].append(run_hf())
    result = {name: statistics.median(r) for name, r in rates.items()}
    result["ratio"] = result["kvserve"] / result["hf_generate"]
    result["rounds"] = rates
    print(json.dumps(result))
    print(
        f"one stream, {args.prompt_tokens}-token prompt, {args.max_tokens} tokens at temperature 1: kvserve "
        f"{result['kvserve']:.1f} tok/s, HF generate {result['hf_generate']:.1f} tok/s ({result['ratio']:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
