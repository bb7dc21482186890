"""Offline throughput and KV memory: kvserve vs HF transformers (one at a time, and static batches).

python -m bench.offline.throughput [--requests 64] [--min-prompt 32] [--max-prompt 512] [--output 128]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.offline.workload import spread_prompts
from executor import LLM, SamplingParams, resolve_model


def run_kvserve(model_dir: str, prompts: list[list[int]], output_len: int, max_model_len: int, args) -> dict:
    llm = LLM(model_dir, max_model_len=max_model_len, max_num_batched_tokens=args.max_num_batched_tokens)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2))  # warm-up outside the clock
    start = time.perf_counter()
    for prompt in prompts:
        llm.add_request(prompt, params)
    peak, peak_tokens_stored, peak_running = llm.stats(), 0, 0
    while llm.engine.has_unfinished():
        llm.step()
        stats = llm.stats()
        peak_running = max(peak_running, stats.running)
        if stats.kv_blocks_used > peak.kv_blocks_used:
            peak, peak_tokens_stored = stats, llm.engine.kv_tokens_stored()
    elapsed = time.perf_counter() - start
    slots = peak.kv_blocks_used * peak.block_size
    return {
        "system": "kvserve",
        "output_tokens": len(prompts) * output_len,
        "seconds": elapsed,
        "output_tok_s": len(prompts) * output_len / elapsed,
        "peak_kv_blocks_used": peak.kv_blocks_used,
        "peak_kv_slots": slots,
        "peak_kv_tokens_stored": peak_tokens_stored,
        "peak_kv_slot_use": peak_tokens_stored / slots,
        "peak_running_requests": peak.running,
        "contiguous_slots_at_peak": peak.running * max_model_len,
        "max_running_requests": peak_running,
    }


def hf_generate(model, batch: list[list[int]], output_len: int) -> None:
    width = max(len(p) for p in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    out = model.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        pad_token_id=0,
    )
    assert out.shape[1] == width + output_len


def run_hf(model_dir: str, prompts: list[list[int]], output_len: int, batch_size: int, label: str) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        hf_generate(model, [prompts[0][:8]], 2)  # warm-up
        start = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            hf_generate(model, prompts[i : i + batch_size], output_len)
        elapsed = time.perf_counter() - start
    return {
        "system": label,
        "requests": len(prompts),
        "output_tokens": len(prompts) * output_len,
        "seconds": elapsed,
        "output_tok_s": len(prompts) * output_len / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the engine's")
    parser.add_argument("--hf-batch", type=int, default=32, help="static batch size for HF")
    parser.add_argument(
        "--hf-single-requests",
        type=int,
        default=16,
        help="HF one-at-a-time runs this many of the requests (evenly picked): its rate is what is compared",
    )
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    model_dir = str(resolve_model(args.model))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = spread_prompts(tokenizer, args.requests, args.min_prompt, args.max_prompt)
    results = [run_kvserve(model_dir, prompts, args.output, args.max_model_len, args)]
    print(json.dumps(results[-1]), flush=True)
    if not args.skip_hf:
        step = max(1, len(prompts) // args.hf_single_requests)
        results.append(run_hf(model_dir, prompts[::step], args.output, 1, "hf-one-at-a-time"))
        print(json.dumps(results[-1]), flush=True)
        results.append(
            run_hf(model_dir, prompts, args.output, args.hf_batch, f"hf-static-batch-{args.hf_batch}")
        )
        print(json.dumps(results[-1]), flush=True)
        ours = results[0]["output_tok_s"]
        print(
            f"kvserve {ours:.1f} tok/s = {ours / results[1]['output_tok_s']:.2f}x HF one-at-a-time, "
            f"{ours / results[2]['output_tok_s']:.2f}x HF static batching"
        )
    r = results[0]
    print(
        f"KV at peak: {r['peak_kv_tokens_stored']} tokens in {r['peak_kv_slots']} allocated slots "
        f"({100 * r['peak_kv_slot_use']:.1f}% used) for {r['peak_running_requests']} running requests; "
        f"reserving max_model_len={args.max_model_len} per request would take {r['contiguous_slots_at_peak']} slots"
    )


if __name__ == "__main__":
    main()
