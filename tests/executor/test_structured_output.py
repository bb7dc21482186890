"""Structured outputs: every output matches its grammar, and a grammar that the model's own choice already meets
changes nothing, with speculation, preemption and unconstrained neighbours in the same batch."""

from __future__ import annotations

import json
import math
import re
import threading

import pytest

from executor import LLM, SamplingParams
from executor.structured_output import Grammars, step_bitmask
from shared.structured_outputs import StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
PHONE = r"[0-9]{3}-[0-9]{4}"
SPEC = dict(speculative_model="ngram", num_speculative_tokens=4, speculative_disable_by_batch_size=64)


def constrained(**kind) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kind)


def regex_literal(text: str) -> str:
    """A regex matching exactly text."""
    special = set("\\^$.|?*+()[]{}/")
    return "".join(
        "\\n" if c == "\n" else "\\t" if c == "\t" else f"\\{c}" if c in special else c for c in text
    )


@pytest.fixture(scope="module")
def llm(default_model) -> LLM:
    return LLM(default_model, kv_cache_memory="64MiB", max_model_len=1024)


@pytest.fixture(scope="module")
def tiny(tiny_models) -> str:
    return tiny_models["llama"]


def test_sampled_outputs_match_their_schema_regex_and_choice(llm):
    cases = [
        ("A person as JSON:", constrained(json=PERSON), lambda t: set(json.loads(t)) == {"name", "age"}),
        (
            "A JSON object with one key:",
            constrained(json_object=True),
            lambda t: isinstance(json.loads(t), dict),
        ),
        ("Call me at", constrained(regex=PHONE), lambda t: re.fullmatch(PHONE, t)),
        ("Is water wet?", constrained(choice=["yes", "no", "maybe"]), lambda t: t in ("yes", "no", "maybe")),
        (
            "Answer with a word and a dot:",
            constrained(grammar='root ::= ("yes" | "no") "."'),
            lambda t: t in ("yes.", "no."),
        ),
    ]
    prompts, params, checks = [], [], []
    for prompt, spec, check in cases:
        for seed in range(3):
            prompts.append(prompt)
            params.append(SamplingParams(max_tokens=40, temperature=0.7, seed=seed, structured_outputs=spec))
            checks.append(check)
    for out, check in zip(llm.generate(prompts, params), checks, strict=True):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        assert check(completion.text), completion.text


def test_a_grammar_the_greedy_output_meets_changes_nothing_and_leaves_neighbours_alone(llm):
    prompts = ["The capital of France is", "Write a haiku about rain:"]
    plain = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    reference = [o.outputs[0] for o in llm.generate(prompts, plain)]
    text = reference[0].text
    as_regex = SamplingParams(
        max_tokens=11, temperature=0.0, structured_outputs=constrained(regex=regex_literal(text))
    )
    as_choice = SamplingParams(
        max_tokens=11, temperature=0.0, structured_outputs=constrained(choice=[text, "Lyon, of course"])
    )
    outs = llm.generate([prompts[0], prompts[0], prompts[1]], [as_regex, as_choice, plain])
    for out in outs[:2]:
        completion = out.outputs[0]
        # the same tokens, then EOS (the only token the finished grammar allows): "stop"
        assert completion.token_ids[:10] == reference[0].token_ids
        assert completion.token_ids[10] in llm.engine.eos_token_ids and completion.finish_reason == "stop"
    assert outs[2].outputs[0].token_ids == reference[1].token_ids  # the unconstrained row beside them


def test_max_tokens_cuts_a_constrained_output_with_length(llm):
    out = llm.generate("A person:", SamplingParams(max_tokens=3, structured_outputs=constrained(json=PERSON)))
    assert out[0].outputs[0].finish_reason == "length" and len(out[0].outputs[0].token_ids) == 3


def test_logprobs_are_those_after_the_mask(llm):
    params = SamplingParams(
        max_tokens=4, temperature=0.0, logprobs=5, structured_outputs=constrained(choice=["yes", "no"])
    )
    completion = llm.generate("Is the sky green?", params)[0].outputs[0]
    first = completion.logprobs[0]
    # only tokens that can start "yes" or "no" are listed, the chosen one first
    assert first.top and first.top[0][0] == first.token_id
    for token_id, _ in first.top:
        piece = llm.tokenizer.decode([token_id])
        assert piece and ("yes".startswith(piece) or "no".startswith(piece)), piece
    assert all(math.isfinite(lp) for _, lp in first.top)
    assert sum(math.exp(lp) for _, lp in first.top) <= 1 + 1e-5


def test_bad_grammars_are_refused_naming_the_field(llm):
    bad = [
        (constrained(json={"type": "nosuch"}), 'structured_outputs.json: Unsupported type "nosuch"'),
        (constrained(regex="(ab"), "structured_outputs.regex: Regex parsing error"),
        (constrained(grammar="root ::= undefined"), "structured_outputs.grammar: EBNF parser error"),
    ]
    for spec, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            llm.generate("x", SamplingParams(max_tokens=4, structured_outputs=spec))
    assert llm.generate("Hi", SamplingParams(max_tokens=2))[0].outputs[0].finish_reason == "length"


def test_a_schema_the_library_would_not_hold_is_refused_naming_it():
    # compiled to nothing by the library: named when the params are made, never served as if it held
    message = (
        "structured_outputs.json uses uniqueItems at /properties/tags (distinct array items), which this "
        "server cannot enforce"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        constrained(json={"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}})


def test_a_grammar_that_fails_while_queued_ends_only_its_request(tiny):
    engine = LLM(tiny, kv_cache_memory="4MiB", max_model_len=512).engine
    gate = threading.Event()
    engine.grammars._workers.submit(gate.wait)  # hold the compile thread, so both grammars below wait
    bad = engine.add_request("bad", [1, 2, 3], SamplingParams(structured_outputs=constrained(regex="[z-a]")))
    good = engine.add_request(
        "good", [1, 2, 3], SamplingParams(max_tokens=3, structured_outputs=constrained(regex="a+"))
    )
    engine.add_request("plain", [4, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
    first = engine.step()
    assert [o.request_id for o in first] == ["plain"]  # not held up by the two compiling
    assert not bad.grammar.ready and not good.grammar.ready
    gate.set()
    finished = {}
    for _ in range(20):
        for out in engine.step():
            if out.finish_reason is not None:
                finished[out.request_id] = out
        if not engine.has_unfinished():
            break
    assert finished["bad"].error.startswith("structured_outputs.regex:") and not finished["bad"].new_token_ids
    assert finished["good"].finish_reason == "length" and finished["plain"].finish_reason == "length"
    assert engine.stats()["kv_blocks_used"] == 0


def _greedy_json(path: str, n: int = 4, **engine_args) -> tuple[list[list[int]], LLM]:
    llm = LLM(path, max_model_len=512, **engine_args)
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=constrained(json=PERSON)),
        SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=constrained(regex="(ab|cd)+")),
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
        SamplingParams(
            max_tokens=40, temperature=0.0, structured_outputs=constrained(choice=["alpha", "beta"])
        ),
    ][:n]
    prompts = [[10 + i, 20, 30, 40, 10 + i, 20, 30] * 3 for i in range(n)]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)], llm


@pytest.mark.slow
def test_speculation_and_preemption_leave_constrained_tokens_unchanged(tiny):
    reference, plain = _greedy_json(tiny, kv_cache_memory="4MiB")
    speculated, with_spec = _greedy_json(tiny, kv_cache_memory="4MiB", **SPEC)
    assert with_spec.stats()["spec_draft_tokens"] > 0
    assert speculated == reference
    drafted, with_draft = _greedy_json(
        tiny, kv_cache_memory="4MiB", **{**SPEC, "speculative_model": tiny, "num_speculative_tokens": 3}
    )
    assert with_draft.stats()["spec_accepted_tokens"] > 0  # the model drafting for itself
    assert drafted == reference
    # 8 blocks of 16 tokens for four requests of 61 tokens: they preempt one another
    engine = plain.engine
    small = 8 * engine.runner.bytes_per_block(engine.runner.model, engine.block_size, engine.dtype)
    preempted, with_preemption = _greedy_json(tiny, kv_cache_memory=small)
    assert with_preemption.stats()["num_preemptions"] > 0
    assert preempted == reference


def test_grammars_compile_once_per_spec_within_a_bounded_cache(llm):
    grammars = Grammars(llm.tokenizer, llm.engine.vocab_size, llm.engine.eos_token_ids, max_cached=2)
    specs = [constrained(regex=r) for r in ("a+", "b+", "c+")]
    grammars.compile(specs[0]).result()
    assert grammars.compile(constrained(regex="a+")) is grammars.compile(specs[0])
    assert grammars.num_compiled == 1
    for spec in specs[1:]:
        grammars.compile(spec).result()
    grammars.compile(specs[0]).result()  # the least recently used, dropped for c+
    assert grammars.num_compiled == 4


def test_a_batch_without_constraints_builds_no_mask():
    assert step_bitmask([None, None], [[], [1, 2]], 49152) is None


@pytest.mark.slow
def test_drawn_draft_proposals_the_grammar_refuses_are_rejected(tiny):
    """A sampled draft's proposals are not cut by value (that would bias rejection sampling): the mask must make
    verification reject the ones the grammar refuses."""
    llm = LLM(tiny, kv_cache_memory="4MiB", max_model_len=512, **{**SPEC, "speculative_model": tiny})
    params = [
        SamplingParams(
            max_tokens=24, temperature=1.0, seed=seed, structured_outputs=constrained(regex="(ab|cd)+")
        )
        for seed in range(3)
    ]
    outs = llm.generate([[10, 20, 30, 40] * 4] * 3, params)
    assert llm.stats()["spec_draft_tokens"] > 0
    for out in outs:
        assert re.fullmatch("((ab|cd)+)?[ac]?", out.outputs[0].text), out.outputs[0].text
