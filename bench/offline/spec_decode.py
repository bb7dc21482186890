"""Speculative decoding: output tokens/s with n-gram lookup or a draft model vs off, and acceptance rates.

    python -m bench.offline.spec_decode single      # one stream at a time on grounded / repetitive outputs
    python -m bench.offline.spec_decode sweep       # 1..8 concurrent streams, back-off off: where speculation stops paying
    python -m bench.offline.spec_decode concurrent  # 32 concurrent streams, back-off on (the default rule)
    python -m bench.offline.spec_decode draft       # a draft made of the default model's first layers
    [--k 4] [--max-tokens 128] [--draft-layers 6] [--repeat 1] [--output FILE.json]

Greedy, so every configuration produces the same tokens: only time differs. The model is the default one.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from executor import LLM, SamplingParams, resolve_model

CODE = """def load_config(path):
    with open(path) as handle:
        data = json.load(handle)
    if "name" not in data:
        raise ValueError("config without a name")
    data["name"] = data["name"].strip()
    return data


def save_config(data, path):
    with open(path, "w") as handle:
        json.dump(data, handle, indent=2)
"""
TEXT = (
    "Virtual memory lets every program believe it owns a large contiguous address space, while the operating "
    "system maps fixed-size pages onto whatever physical frames are free. When a page is not in memory, the "
    "hardware raises a page fault and the kernel loads it from disk."
)
WORKLOADS = {
    "rename-variable": CODE + "\nRewrite this code with the variable `data` renamed to `config`.",
    "add-docstrings": CODE + "\nAdd a docstring to each function and return the whole code.",
    "repeat-text": "Repeat the following text exactly, word for word:\n\n" + TEXT,
    "summarise-with-quotes": TEXT + "\n\nSummarise the text above in two sentences, quoting it directly.",
}


def chat(llm: LLM, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return llm.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


class ProposerTimer:
    """Wraps the n-gram proposer to add up the time it takes, to set beside the time of the steps."""

    def __init__(self, llm: LLM) -> None:
        self.seconds = 0.0
        self.calls = 0
        proposer = llm.engine.ngram
        if proposer is None:
            return
        propose = proposer.propose

        def timed(token_ids, k):
            start = time.perf_counter()
            try:
                return propose(token_ids, k)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        proposer.propose = timed


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    """All prompts submitted at once; output tokens/s over the whole run, per-step times, acceptance."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    timer = ProposerTimer(llm)
    before = llm.stats()
    for prompt in prompts:
        llm.add_request(prompt, params)
    outputs: dict[str, list[int]] = {}
    steps = 0
    start = time.perf_counter()
    while llm.engine.has_unfinished():
        for out in llm.step():
            outputs[out.request_id] = out.outputs[0].token_ids
        steps += 1
    elapsed = time.perf_counter() - start
    stats = llm.stats()
    drafted = stats.spec_draft_tokens - before.spec_draft_tokens
    accepted = stats.spec_accepted_tokens - before.spec_accepted_tokens
    tokens = sum(len(t) for t in outputs.values())
    return {
        "output_tokens": tokens,
        "seconds": elapsed,
        "output_tok_s": tokens / elapsed,
        "steps": steps,
        "ms_per_step": 1000 * elapsed / steps,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "ngram_us_per_step": 1e6 * timer.seconds / steps if timer.calls else None,
        "ngram_us_per_call": 1e6 * timer.seconds / timer.calls if timer.calls else None,
        "outputs": [outputs[k] for k in sorted(outputs, key=int)],
    }


def engine(model: str, **spec) -> LLM:
    llm = LLM(model, kv_cache_memory="1GiB", max_model_len=2048, **spec)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))  # warm-up outside the clock
    return llm


def compare(model: str, configs: dict[str, dict], prompts_of, max_tokens: int, repeat: int = 1) -> dict:
    """Each configuration on the same prompts, `repeat` rounds taking turns (so a noisy neighbour hits all
    alike), the median round kept; the first configuration is the baseline every other must match token for
    token (greedy) and is measured against."""
    engines = {name: engine(model, **spec) for name, spec in configs.items()}
    rounds: dict[str, list[dict]] = {name: [] for name in configs}
    for _ in range(repeat):
        for name, llm in engines.items():
            rounds[name].append(run(llm, prompts_of(llm), max_tokens))
    results = {}
    for name, runs in rounds.items():
        runs.sort(key=lambda r: r["output_tok_s"])
        results[name] = dict(runs[len(runs) // 2], rounds_tok_s=[r["output_tok_s"] for r in runs])
    base = next(iter(results.values()))
    for name, result in results.items():
        if result["outputs"] != base["outputs"]:
            raise AssertionError(f"{name}: output differs from the baseline")
        result["speedup"] = result["output_tok_s"] / base["output_tok_s"]
    for result in results.values():
        del result["outputs"]
    return results


def single(model: str, args) -> dict:
    ngram = dict(speculative_model="ngram", num_speculative_tokens=args.k)
    configs = {"off": {}, f"ngram k={args.k}": ngram}
    return {
        name: compare(model, configs, lambda llm, text=text: [chat(llm, text)], args.max_tokens, args.repeat)
        for name, text in WORKLOADS.items()
    }


def many(n: int):
    texts = list(WORKLOADS.values())

    def prompts(llm: LLM) -> list[list[int]]:
        # every stream its own prompt: the same four tasks, each numbered differently
        return [chat(llm, f"Task {i}. " + texts[i % len(texts)]) for i in range(n)]

    return prompts


def sweep(model: str, args) -> dict:
    always = dict(
        speculative_model="ngram", num_speculative_tokens=args.k, speculative_disable_by_batch_size=10**6
    )
    configs = {"off": {}, f"ngram k={args.k}, no batch back-off": always}
    return {
        f"{n} streams": compare(model, configs, many(n), args.max_tokens, args.repeat) for n in (1, 2, 4, 8)
    }


def concurrent(model: str, args) -> dict:
    ngram = dict(speculative_model="ngram", num_speculative_tokens=args.k)
    no_backoff = dict(ngram, speculative_disable_by_batch_size=10**6)
    configs = {"off": {}, f"ngram k={args.k}": ngram, f"ngram k={args.k}, no batch back-off": no_backoff}
    return compare(model, configs, many(args.streams), args.max_tokens, args.repeat)


def first_layers(model: str, num_layers: int, out_dir: Path) -> Path:
    """A draft made of the model's first num_layers layers (plus its embeddings, final norm and head)."""
    from safetensors.torch import load_file, save_file

    src = Path(model)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, out_dir / f.name)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    weights = {}
    for f in src.glob("*.safetensors"):
        for name, tensor in load_file(f).items():
            parts = name.split(".")
            if parts[:2] == ["model", "layers"] and int(parts[2]) >= num_layers:
                continue
            weights[name] = tensor.contiguous()
    save_file(weights, out_dir / "model.safetensors")
    return out_dir


def draft(model: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = str(first_layers(model, args.draft_layers, Path(tmp)))
        configs = {
            "off": {},
            f"draft: first {args.draft_layers} layers, k={args.k}": dict(
                speculative_model=path, num_speculative_tokens=args.k
            ),
            f"ngram k={args.k}": dict(speculative_model="ngram", num_speculative_tokens=args.k),
            # the mechanism's ceiling: a draft that is always right (and costs as much as the target)
            f"draft: the target itself, k={args.k}": dict(
                speculative_model=model, num_speculative_tokens=args.k
            ),
        }
        return {
            name: compare(
                model, configs, lambda llm, text=text: [chat(llm, text)], args.max_tokens, args.repeat
            )
            for name, text in WORKLOADS.items()
        }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("part", choices=["single", "sweep", "concurrent", "draft"])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--draft-layers", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=1, help="rounds per configuration; the median is kept")
    parser.add_argument("--output", help="write the results here as JSON")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = str(resolve_model(None))
    result = {"single": single, "sweep": sweep, "concurrent": concurrent, "draft": draft}[args.part](
        model, args
    )
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text)


if __name__ == "__main__":
    main()
