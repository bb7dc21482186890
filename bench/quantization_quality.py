"""What quantized weights cost in quality, offline in one process, for each kvserve variant of the default model
(bench/quantized_models.py: float32, int8, Q8_0 and Q4_1 GGUF):

- bits per byte of a held text (bench/texts/alice_chapter1.txt, the public-domain opening of Alice's Adventures
  in Wonderland, 2.6 KB): the text's negative log-likelihood in bits, every token after the first scored, over its
  UTF-8 bytes;
- greedy agreement with float32: a fixed set of chat prompts, --max-tokens each at temperature 0 with EOS
  ignored; how many match float32's tokens exactly, and their mean common prefix.

    python -m bench.quantization_quality [--variants float32,int8,q8_0,q4_1] [--prompts 16] [--max-tokens 32]
                                         [--out bench/results/quantization_quality]

Writes summary.json and summary.md under --out. A variant the engine refuses (int8 where --quantization does not
offer it) is reported with its error, and the others still run.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path

import torch

from bench.quantized_models import VARIANTS, variant_model
from executor import LLM, SamplingParams, weight_bytes

HELD_TEXT = Path(__file__).resolve().parent / "texts" / "alice_chapter1.txt"
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a child.",
    "List three uses of a paperclip.",
    "What is 17 times 23?",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "Summarize the plot of Romeo and Juliet.",
    "What are the planets of the solar system?",
    "Translate 'good morning' into Spanish and French.",
    "Describe a cat in two sentences.",
    "What causes the seasons on Earth?",
    "Suggest a name for a bakery.",
    "How do vaccines work?",
    "Write the opening line of a mystery novel.",
]


def bits_per_byte(llm: LLM, text: str) -> float:
    ids = llm.tokenizer.encode(text)
    out = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    nats = -sum(entry.logprob for entry in out.prompt_logprobs[1:])
    return nats / math.log(2) / len(text.encode())


def greedy(llm: LLM, prompts: list[str], max_tokens: int) -> list[list[int]]:
    chats = [
        llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for p in prompts
    ]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(chats, params)]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def measure(name: str, prompts: list[str], max_tokens: int) -> dict:
    model_dir, quantization = variant_model(name)
    try:
        llm = LLM(model_dir, quantization=quantization, max_model_len=2048, kv_cache_memory="512MiB")
    except ValueError as error:  # a --quantization this build does not offer
        return {"variant": name, "error": str(error)}
    start = time.perf_counter()
    result = {
        "variant": name,
        "quantization": quantization,
        "model": model_dir,
        "weight_mib": weight_bytes(llm.engine.runner.model) / 2**20,
        "bits_per_byte": bits_per_byte(llm, HELD_TEXT.read_text()),
        "tokens": greedy(llm, prompts, max_tokens),
    }
    result["seconds"] = time.perf_counter() - start
    del llm
    gc.collect()
    return result


def markdown(results: list[dict], prompts: int, max_tokens: int) -> str:
    reference = next((r["tokens"] for r in results if r["variant"] == "float32" and "tokens" in r), None)
    lines = [
        f"| variant | weights MiB | bits per byte | greedy = float32 ({prompts} prompts x {max_tokens} tokens) "
        "| mean common prefix |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['variant']} | — | — | {r['error']} | — |")
            continue
        agree = prefix = "—"
        if reference is not None:
            agree = f"{sum(a == b for a, b in zip(r['tokens'], reference, strict=True))}/{len(reference)}"
            mean = sum(common_prefix(a, b) for a, b in zip(r["tokens"], reference, strict=True)) / len(
                reference
            )
            prefix = f"{mean:.1f}"
        lines.append(
            f"| {r['variant']} | {r['weight_mib']:.0f} | {r['bits_per_byte']:.4f} | {agree} | {prefix} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated: {', '.join(VARIANTS)}"
    )
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"1-{len(PROMPTS)}")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("bench/results/quantization_quality"))
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if unknown := [v for v in variants if v not in VARIANTS]:
        parser.error(f"--variants: unknown variant {unknown[0]!r} ({', '.join(VARIANTS)})")
    if not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--prompts must be 1-{len(PROMPTS)}")
    if args.max_tokens < 1:
        parser.error("--max-tokens must be at least 1")
    torch.set_num_threads(2)
    prompts = PROMPTS[: args.prompts]
    results = []
    for name in variants:
        results.append(measure(name, prompts, args.max_tokens))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "tokens"}), flush=True)
    table = markdown(results, len(prompts), args.max_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(results, indent=1))
    (args.out / "summary.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
