"""What quantized weights and activations cost in quality, offline in one process, for each kvserve variant of the
default model (bench/quantized_models.py: float32, int8, Q8_0 and Q4_1 GGUF), each with its default activations or
as VARIANT:ACTIVATIONS (--quantized-activations, e.g. q4_1:float32):

- bits per byte of a held text (bench/texts/alice_chapter1.txt, the public-domain opening of Alice's Adventures
  in Wonderland, 2.6 KB): the text's negative log-likelihood in bits, every token after the first scored, over its
  UTF-8 bytes;
- greedy agreement with float32: a fixed set of chat prompts, --max-tokens each at temperature 0 with EOS
  ignored; how many match float32's tokens exactly, and their mean common prefix;
- factual answers: simple questions (bench/texts/factual_heldout.jsonl, one JSON object a line: question and its
  accepted answers) answered greedily in the chat template; a question counts where one of its answers appears in
  the reply as a whole word, in any case. The held-out set is what is reported: the activations' rounding was
  chosen on factual_dev.jsonl alone (--factual dev), so the held-out score measures what nothing was tuned for;
- the README's example, "What is the capital of France?" greedily: the reply's start, and whether it says Paris.

    python -m bench.quantization_quality [--variants float32,int8,q8_0,q4_1,q8_0:float32,q4_1:float32,...]
                                         [--prompts 16] [--max-tokens 32] [--factual heldout]
                                         [--out bench/results/quantization_quality]

Writes summary.json and summary.md under --out. A variant the engine refuses (int8 where --quantization does not
offer it) is reported with its error, and the others still run.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.quantized_models import VARIANTS, split_variant, variant_list, variant_model
from executor import LLM, SamplingParams, weight_bytes

TEXTS = Path(__file__).resolve().parent / "texts"
HELD_TEXT = TEXTS / "alice_chapter1.txt"
FACTUAL_SETS = {"heldout": TEXTS / "factual_heldout.jsonl", "dev": TEXTS / "factual_dev.jsonl"}
# variants besides VARIANTS' own: a GGUF served as it is, its matrices multiplying float32 or int16 activations
DEFAULT_VARIANTS = (*VARIANTS, "q8_0:float32", "q4_1:float32", "q8_0:int16", "q4_1:int16")
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


@dataclass(frozen=True, slots=True)
class FactualQuestion:
    question: str
    answers: tuple[str, ...]  # any one of them, as a whole word in any case, makes a reply right

    def answered_by(self, reply: str) -> bool:
        """Whether the reply holds one of the answers, not as part of a longer word or number ("lion" is not in
        "million", "24" not in "240")."""
        return any(
            re.search(rf"(?<![^\W_]){re.escape(answer)}(?![^\W_])", reply, re.IGNORECASE)
            for answer in self.answers
        )


# the README's example; int8 activations in blocks of 32 tipped its near-tie first token to "L'Étoile, ..." (issue 47)
README_EXAMPLE = FactualQuestion("What is the capital of France?", ("Paris",))


def load_factual(path: Path) -> list[FactualQuestion]:
    """One JSON object a line: {"question": str, "answers": [str, ...]}; a malformed line is an error naming it."""
    questions = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        item = json.loads(line)
        answers = item.get("answers")
        if (
            not isinstance(item.get("question"), str)
            or not answers
            or not all(isinstance(a, str) and a for a in answers)
        ):
            raise ValueError(f"{path}:{number}: needs a question and a non-empty list of answers")
        questions.append(FactualQuestion(item["question"], tuple(answers)))
    return questions


def chat_prompts(llm: LLM, questions: list[str]) -> list[list[int]]:
    return [
        llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for q in questions
    ]


def replies(llm: LLM, questions: list[str], max_tokens: int = 48) -> list[str]:
    """Greedy replies in the chat template, each ending at EOS or max_tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return [o.outputs[0].text for o in llm.generate(chat_prompts(llm, questions), params)]


def bits_per_byte(llm: LLM, text: str) -> float:
    ids = llm.tokenizer.encode(text)
    out = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    nats = -sum(entry.logprob for entry in out.prompt_logprobs[1:])
    return nats / math.log(2) / len(text.encode())


def greedy(llm: LLM, prompts: list[str], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(chat_prompts(llm, prompts), params)]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def measure(name: str, prompts: list[str], max_tokens: int, factual: list[FactualQuestion]) -> dict:
    """One variant, VARIANT or VARIANT:ACTIVATIONS."""
    base, activations = split_variant(name)
    model_dir, quantization = variant_model(base)
    options = {"quantized_activations": activations} if activations else {}
    try:
        llm = LLM(
            model_dir, quantization=quantization, max_model_len=2048, kv_cache_memory="512MiB", **options
        )
    except ValueError as error:  # a --quantization or --quantized-activations this build does not offer
        return {"variant": name, "error": str(error)}
    start = time.perf_counter()
    answers = replies(llm, [q.question for q in [*factual, README_EXAMPLE]])
    result = {
        "variant": name,
        "quantization": quantization,
        "quantized_activations": activations or "default",
        "model": model_dir,
        "weight_mib": weight_bytes(llm.engine.runner.model) / 2**20,
        "bits_per_byte": bits_per_byte(llm, HELD_TEXT.read_text()),
        "tokens": greedy(llm, prompts, max_tokens),
        "factual": sum(q.answered_by(a) for q, a in zip(factual, answers[:-1], strict=True)),
        "factual_of": len(factual),
        "factual_replies": answers[:-1],
        "readme_reply": answers[-1],
    }
    result["seconds"] = time.perf_counter() - start
    del llm
    gc.collect()
    return result


def readme_cell(reply: str) -> str:
    """The README example's reply as a table cell: whether it says Paris, and how it starts."""
    start = " ".join(reply.split())[:40].replace("|", "/")
    return f"{'Paris' if README_EXAMPLE.answered_by(reply) else 'not Paris'}: {start}"


def markdown(results: list[dict], prompts: int, max_tokens: int, factual_set: str) -> str:
    reference = next((r["tokens"] for r in results if r["variant"] == "float32" and "tokens" in r), None)
    lines = [
        f"| variant | weights MiB | bits per byte | greedy = float32 ({prompts} prompts x {max_tokens} tokens) "
        f"| mean common prefix | factual {factual_set} | README example |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['variant']} | — | — | {r['error']} | — | — | — |")
            continue
        agree = prefix = "—"
        if reference is not None:
            agree = f"{sum(a == b for a, b in zip(r['tokens'], reference, strict=True))}/{len(reference)}"
            mean = sum(common_prefix(a, b) for a, b in zip(r["tokens"], reference, strict=True)) / len(
                reference
            )
            prefix = f"{mean:.1f}"
        lines.append(
            f"| {r['variant']} | {r['weight_mib']:.0f} | {r['bits_per_byte']:.4f} | {agree} | {prefix} "
            f"| {r['factual']}/{r['factual_of']} | {readme_cell(r['readme_reply'])} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--variants",
        type=variant_list,
        default=",".join(DEFAULT_VARIANTS),
        help=f"comma-separated: {', '.join(VARIANTS)}, each optionally :ACTIVATIONS (--quantized-activations)",
    )
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"1-{len(PROMPTS)}")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--factual",
        choices=sorted(FACTUAL_SETS),
        default="heldout",
        help="the factual set to score: heldout (the report) or dev (what the rounding was tuned on)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/quantization_quality"))
    args = parser.parse_args(argv)
    variants = args.variants
    if not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--prompts must be 1-{len(PROMPTS)}")
    if args.max_tokens < 1:
        parser.error("--max-tokens must be at least 1")
    torch.set_num_threads(2)
    prompts = PROMPTS[: args.prompts]
    factual = load_factual(FACTUAL_SETS[args.factual])
    results = []
    for name in variants:
        results.append(measure(name, prompts, args.max_tokens, factual))
        shown = {k: v for k, v in results[-1].items() if k not in ("tokens", "factual_replies")}
        print(json.dumps(shown), flush=True)
    table = markdown(results, len(prompts), args.max_tokens, args.factual)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(results, indent=1))
    (args.out / "summary.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
