"""Structured outputs: what constrained decoding costs and what it buys, on the default model.

    python -m bench.offline.structured_outputs overhead    # mask work as a share of a decode step, batch 1 and 32
    python -m bench.offline.structured_outputs compile     # grammar compile time (in the compile process, sent back and
                                                   # loaded), typical and large schema, cold/cached
    python -m bench.offline.structured_outputs compliance  # 100 sampled outputs valid against the schema, with/without
    python -m bench.offline.structured_outputs all [--output FILE.json]

Mask work is the engine's own count (stats().structured_output_mask_seconds: filling each constrained row's
bitmask and applying it to the logits), divided by the wall time of the same decode steps.
"""

from __future__ import annotations

import argparse
import json
import time

import jsonschema

from executor import LLM, SamplingParams
from shared.structured_outputs import StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 40},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "age", "email", "hobbies"],
    "additionalProperties": False,
}
PROMPT = "Invent a person and describe them as a JSON object with name, age, email and hobbies.\n"


def large_schema(num_objects: int = 40) -> dict:
    """An API-style schema: many object types with nested references, enums and patterns."""
    defs = {}
    for i in range(num_objects):
        defs[f"Item{i}"] = {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": f"^item{i}-[0-9a-f]{{8}}$"},
                "kind": {"enum": [f"k{i}-{j}" for j in range(6)]},
                "count": {"type": "integer", "minimum": 0, "maximum": 10_000},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
                "next": {"$ref": f"#/$defs/Item{(i + 1) % num_objects}"} if i % 4 == 0 else {"type": "null"},
            },
            "required": ["id", "kind", "count"],
        }
    return {
        "type": "object",
        "properties": {f"field{i}": {"$ref": f"#/$defs/Item{i}"} for i in range(num_objects)},
        "required": ["field0"],
        "$defs": defs,
    }


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 2)


def overhead(llm: LLM, batch: int, max_tokens: int) -> dict:
    """Decode steps of `batch` JSON-constrained rows: mask time / step time (prefill steps left out)."""
    spec = StructuredOutputsParams(json=PERSON)
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.8, seed=0, ignore_eos=True, structured_outputs=spec
    )
    for i in range(batch):
        llm.add_request(PROMPT, params, request_id=f"overhead-{batch}-{i}")
    while llm.engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in llm.engine.scheduler.running
    ):
        llm.step()  # prefill
    mask_before, steps, started = llm.stats().structured_output_mask_seconds, 0, time.perf_counter()
    while llm.engine.has_unfinished():
        llm.step()
        steps += 1
    wall = time.perf_counter() - started
    mask = llm.stats().structured_output_mask_seconds - mask_before
    return {
        "batch": batch,
        "steps": steps,
        "step_ms": _ms(wall / steps),
        "mask_ms": _ms(mask / steps),
        "mask_share": round(mask / wall, 4),
    }


def compile_times(llm: LLM) -> dict:
    started = time.perf_counter()
    llm.engine.grammars  # noqa: B018 - the tokenizer info, built once per model on first use
    out = {"tokenizer_info_ms": _ms(time.perf_counter() - started)}
    started = (
        time.perf_counter()
    )  # the compile process starts with the grammars: the first compile waits for it
    llm.engine.grammars.compile(StructuredOutputsParams(regex="a")).result()
    out["compile_process_start_ms"] = _ms(time.perf_counter() - started)
    for name, schema in (("typical", PERSON), ("large", large_schema())):
        spec = StructuredOutputsParams(json=schema)
        started = time.perf_counter()
        llm.engine.grammars.compile(spec).result()
        cold = time.perf_counter() - started
        started = time.perf_counter()
        llm.engine.grammars.compile(StructuredOutputsParams(json=schema)).result()
        cached = time.perf_counter() - started
        out[name] = {
            "schema_bytes": len(spec.json),
            "cold_ms": _ms(cold),
            "cached_ms": round(cached * 1e3, 4),
        }
    return out


def compliance(llm: LLM, n: int, max_tokens: int, unconstrained: bool = True) -> dict:
    """n sampled outputs (seeds 0..n-1) constrained and not: the share that parse and validate."""
    out = {}
    kinds = [("constrained", StructuredOutputsParams(json=PERSON)), ("unconstrained", None)]
    for name, spec in kinds if unconstrained else kinds[:1]:
        params = [
            SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, structured_outputs=spec)
            for seed in range(n)
        ]
        valid, failures, lengths = 0, [], []
        for seed, result in enumerate(llm.generate([PROMPT] * n, params)):
            completion = result.outputs[0]
            lengths.append(len(completion.token_ids))
            try:
                jsonschema.validate(json.loads(completion.text), PERSON)
                valid += 1
            except (ValueError, jsonschema.ValidationError) as error:
                failures.append(
                    {"seed": seed, "finish_reason": completion.finish_reason, "why": str(error)[:200]}
                )
        cut = sum(1 for length in lengths if length >= max_tokens)
        out[name] = {
            "valid": valid,
            "of": n,
            "max_tokens": max_tokens,
            "longest_output_tokens": max(lengths),
            "cut_at_max_tokens": cut,
            "first_failures": failures[:3],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", choices=("overhead", "compile", "compliance", "all"))
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--samples", type=int, default=100)
    # room for the schema's output: at 96, 1 of 100 sampled outputs (101 tokens, of short tokens) was cut short
    parser.add_argument("--compliance-tokens", type=int, default=256)
    parser.add_argument("--constrained-only", action="store_true")
    parser.add_argument("--output")
    args = parser.parse_args()
    llm = LLM(None, kv_cache_memory="1GiB", max_num_seqs=64)
    report = {}
    if args.mode in ("compile", "all"):
        report["compile"] = compile_times(llm)
        print(json.dumps(report["compile"]), flush=True)
    if args.mode in ("overhead", "all"):
        report["overhead"] = [overhead(llm, batch, args.max_tokens) for batch in (1, 32)]
        print(json.dumps(report["overhead"]), flush=True)
    if args.mode in ("compliance", "all"):
        report["compliance"] = compliance(
            llm, args.samples, args.compliance_tokens, not args.constrained_only
        )
        print(json.dumps(report["compliance"]), flush=True)
    if args.output:
        with open(args.output, "w") as handle:
            json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
