"""Structured outputs: every output matches its grammar, and a grammar that the model's own choice already meets
changes nothing, with speculation, preemption and unconstrained neighbours in the same batch. Compiles stall no one:
one past its deadline fails alone, requests waiting for theirs hold no place in the waiting queue, tenants take
turns and share no cached grammar, and the compile process never outlives its owner."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from executor import LLM, SamplingParams
from executor.engine import Engine
from executor.engine_busy import EngineBusy
from executor.kv.layout import kv_block_bytes
from executor.structured.grammar_masks import step_bitmask
from executor.structured.grammars import Grammars
from shared.structured_outputs import StructuredOutputsParams
from shared.tenant import Tenant
from tests.processes import REPO, eventually

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
DEADLINE_S = 0.5  # the tiny engine's --grammar-compile-timeout, and its --grammar-fast-budget: one lane


def slow_regex(classes: int = 60) -> str:
    """A regex whose compile time grows with the square of its length: seconds at 60 classes (300 bytes)."""
    return "".join(f"[^{chr(ord('a') + i % 26)}]*" for i in range(classes))


def gone(pid: int) -> bool:
    """No such process, or only its zombie (a container's init may never reap an orphan)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def run_to_the_end(engine: Engine, timeout_s: float = 120) -> tuple[dict, dict]:
    """Step until nothing is left: each request's last output, in the order they ended, and its tokens."""
    finished, tokens, deadline = {}, {}, time.monotonic() + timeout_s
    while engine.has_unfinished():
        assert time.monotonic() < deadline, f"still unfinished: {sorted(engine.intake.requests)}"
        for out in engine.step().outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                finished[out.request_id] = out
    return finished, tokens


def salted(name: str) -> Tenant:
    """The tenant of that name, salted with it."""
    return Tenant(name, name)


def constrained(**kind) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kind)


def regex_literal(text: str) -> str:
    """A regex matching exactly text."""
    special = set("\\^$.|?*+()[]{}/")
    return "".join(
        "\\n" if c == "\n" else "\\t" if c == "\t" else f"\\{c}" if c in special else c for c in text
    )


@pytest.fixture(scope="module")
def llm(default_model):
    llm = LLM(default_model, kv_cache_memory="64MiB", max_model_len=1024)
    yield llm
    llm.engine.close()


@pytest.fixture(scope="module")
def tiny(tiny_models) -> str:
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def tiny_engine(tiny):
    """One engine for the compile tests, a short deadline and room for 3 requests waiting for their grammars;
    each test leaves it with nothing unfinished. Its fast lane's budget is the deadline, so every compile runs
    there and what waits behind what does not depend on when a spec moves lanes (test_grammar_lanes.py)."""
    engine = LLM(
        tiny,
        kv_cache_memory="4MiB",
        max_model_len=512,
        grammar_compile_timeout=DEADLINE_S,
        grammar_fast_budget=DEADLINE_S,
        max_waiting_seqs=3,
    ).engine
    yield engine
    engine.close()


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


def test_a_grammar_that_fails_while_queued_ends_only_its_request(tiny_engine):
    engine = tiny_engine
    # the worker busy with another tenant's compile (killed at the deadline), so both grammars below wait
    engine.grammars.compile(constrained(regex=slow_regex()), salted("holder"))
    (bad,) = engine.add_request(
        "bad", [1, 2, 3], SamplingParams(structured_outputs=constrained(regex="[z-a]"))
    )
    (good,) = engine.add_request(
        "good", [1, 2, 3], SamplingParams(max_tokens=3, structured_outputs=constrained(regex="a+"))
    )
    engine.add_request("plain", [4, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
    first = engine.step().outputs
    assert [o.request_id for o in first] == ["plain"]  # not held up by the two compiling
    assert not bad.grammar.ready and not good.grammar.ready
    finished, tokens = run_to_the_end(engine)
    assert finished["bad"].error.startswith("structured_outputs.regex:") and not finished["bad"].new_token_ids
    assert finished["bad"].error_code == 400
    assert finished["good"].finish_reason == "length" and finished["plain"].finish_reason == "length"
    assert engine.stats().kv_blocks_used == 0


def test_a_grammar_past_its_deadline_fails_alone_and_the_next_compiles_in_a_fresh_process(tiny_engine):
    engine = tiny_engine
    slow = SamplingParams(max_tokens=3, structured_outputs=constrained(regex=slow_regex()))
    engine.add_request("slow", [1, 2, 3], slow)
    engine.add_request("plain", [4, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
    after = SamplingParams(max_tokens=4, temperature=0.0, structured_outputs=constrained(regex="(ab)+"))
    engine.add_request("after", [7, 8, 9], after)  # the same tenant's, so compiled after "slow"
    assert eventually(lambda: engine.grammars.worker_pids[0] is not None, timeout=30)
    first_pid = engine.grammars.worker_pids[0]
    finished, tokens = run_to_the_end(engine)
    assert list(finished)[0] == "plain"  # it never waited for the compile
    assert finished["slow"].error == (
        "structured_outputs.regex: compiling it took longer than the 0.5 s limit (--grammar-compile-timeout)"
    )
    assert finished["slow"].error_code == 400 and not finished["slow"].new_token_ids
    assert finished["after"].error is None and finished["after"].finish_reason in ("stop", "length")
    assert re.fullmatch("((ab)+)?a?", engine.tokenizer.decode(tokens["after"], skip_special_tokens=True))
    assert gone(first_pid) and engine.grammars.worker_pids[0] not in (None, first_pid)
    assert engine.stats().kv_blocks_used == 0


def test_a_compile_process_that_dies_fails_its_request_as_our_fault_and_is_replaced(tiny_engine):
    engine, grammars = tiny_engine, tiny_engine.grammars
    grammars.compile(constrained(regex="(warm)+"), salted("dies")).result(timeout=120)
    grammars.timeout_s = grammars.fast_budget_s = 120  # for this test: time to kill the process mid-compile
    try:
        params = SamplingParams(max_tokens=2, structured_outputs=constrained(regex=slow_regex(70)))
        engine.add_request("dies", [1, 2, 3], params, salted("dies"))
        pid = grammars.worker_pids[0]
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        finished, _ = run_to_the_end(engine)
    finally:
        grammars.timeout_s = grammars.fast_budget_s = DEADLINE_S
    assert finished["dies"].error_code == 500  # the spec may well be fine: it is not called bad
    assert "structured_outputs.regex: the grammar compiler failed" in finished["dies"].error
    assert grammars.compile(constrained(regex="(after)+"), salted("dies")).result(timeout=120) is not None
    assert gone(pid) and grammars.worker_pids[0] not in (None, pid)


def test_requests_waiting_for_their_grammar_hold_no_place_in_the_waiting_queue(tiny_engine):
    engine = tiny_engine
    ready = constrained(regex="(xy)+")
    engine.grammars.compile(ready, salted("alpha")).result()  # compiled before: a request for it never waits
    specs = [constrained(regex=slow_regex(50 + i)) for i in range(3)]
    for i, spec in enumerate(specs):
        params = SamplingParams(max_tokens=2, structured_outputs=spec)
        engine.add_request(f"c{i}", [1, 2, 3], params, tenant=salted("alpha"))
    assert (
        len(engine.grammar_queue.requests) == 3
        and not engine.scheduler.waiting
        and not engine.stats().queue_full
    )
    assert engine.stats().waiting == 3 and engine.stats().compiling == 3
    more = SamplingParams(max_tokens=2, structured_outputs=constrained(regex="(zw)+"))
    with pytest.raises(EngineBusy, match="3 of this tenant's requests already wait for their grammars"):
        engine.add_request("refused", [1, 2, 3], more, tenant=salted("alpha"))
    assert "refused" not in engine.intake.requests
    assert engine.grammars.lookup(more.structured_outputs, salted("alpha")) is None  # nothing queued for it
    engine.add_request("beta", [1, 2, 3], more, tenant=salted("beta"))  # another tenant still has room
    assert len(engine.grammar_queue.requests) == 4 and not engine.stats().queue_full
    assert engine.abort("beta") == [0]
    engine.add_request(
        "ready", [1, 2, 3], SamplingParams(max_tokens=2, structured_outputs=ready), salted("alpha")
    )
    engine.add_request("plain", [4, 5, 6], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(engine.scheduler.waiting) == 2
    # c2 waits behind c0 and c1: aborted, its compile is dropped unstarted, and asked again it compiles afresh
    queued = engine.intake.requests["c2"].grammar.future
    assert engine.abort("c2") == [0] and queued.cancelled()
    assert engine.grammars.lookup(specs[2], salted("alpha")) is None
    assert engine.abort("c0") == [0] and engine.abort("c1") == [0]
    assert not engine.grammar_queue.requests and engine.stats().waiting == 2
    finished, tokens = run_to_the_end(engine)
    assert set(finished) == {"ready", "plain"} and finished["ready"].error is None
    assert engine.stats().kv_blocks_used == 0


def test_all_tenants_together_have_four_times_one_tenants_places(tiny_engine):
    engine, added = tiny_engine, []
    for tenant in range(4):
        for i in range(3):  # --max-waiting-seqs 3: each tenant's most
            spec = constrained(regex=f"(t{tenant}r{i})+{slow_regex(45)}")
            added.append(f"t{tenant}-{i}")
            engine.add_request(
                added[-1], [1, 2, 3], SamplingParams(structured_outputs=spec), salted(f"t{tenant}")
            )
    late = SamplingParams(structured_outputs=constrained(regex="(late)+"))
    with pytest.raises(EngineBusy, match="12 requests already wait for their grammars to compile"):
        engine.add_request("late", [1, 2, 3], late, salted("t4"))
    engine.add_request("plain", [4, 5, 6], SamplingParams(max_tokens=2, ignore_eos=True), salted("t4"))
    for request_id in added:
        engine.abort(request_id)
    finished, _ = run_to_the_end(engine)
    assert list(finished) == ["plain"] and not engine.grammar_queue.requests


def test_tenants_take_turns_at_the_compiler(tiny_engine):
    grammars, served = tiny_engine.grammars, []
    queued = [("t-a", "a1"), ("t-a", "a2"), ("t-a", "a3"), ("t-b", "b1"), ("t-b", "b2"), ("t-c", "c1")]
    futures = []
    for tenant, name in queued:  # a1 may start at once or not: the turns come out the same
        future = grammars.compile(constrained(regex=f"{name}(x|y)+"), salted(tenant))
        future.add_done_callback(lambda _, name=name: served.append(name))  # called in compile order
        futures.append(future)
    for future in futures:
        future.result(timeout=120)
    assert served == ["a1", "b1", "c1", "a2", "b2", "a3"]


def test_a_tenants_cached_grammar_is_no_hit_for_another(tiny_engine):
    grammars = tiny_engine.grammars
    spec = constrained(regex="(ab|ba)+c")
    alpha = grammars.compile(spec, salted("alpha"))
    alpha.result(timeout=120)
    compiled = grammars.num_compiled
    assert (
        grammars.compile(constrained(regex="(ab|ba)+c"), salted("alpha")) is alpha
    )  # a hit: the tenant's own
    assert grammars.lookup(spec, salted("beta")) is None and grammars.lookup(spec) is None
    beta = grammars.compile(spec, salted("beta"))
    assert beta is not alpha and grammars.num_compiled == compiled + 1
    beta.result(timeout=120)


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
    assert with_spec.stats().spec_draft_tokens > 0
    assert speculated == reference
    drafted, with_draft = _greedy_json(
        tiny, kv_cache_memory="4MiB", **{**SPEC, "speculative_model": tiny, "num_speculative_tokens": 3}
    )
    assert with_draft.stats().spec_accepted_tokens > 0  # the model drafting for itself
    assert drafted == reference
    # 8 blocks of 16 tokens for four requests of 61 tokens: they preempt one another
    engine = plain.engine
    small = 8 * kv_block_bytes(engine.runner.model.spec, engine.block_size, engine.dtype)
    preempted, with_preemption = _greedy_json(tiny, kv_cache_memory=small)
    assert with_preemption.stats().preemptions > 0
    assert preempted == reference


def test_grammars_compile_once_per_spec_within_a_bounded_cache_and_close_ends_their_process(llm):
    grammars = Grammars(llm.tokenizer, llm.engine.vocab_size, llm.engine.eos_token_ids, 10.0, max_cached=2)
    specs = [constrained(regex=r) for r in ("a+", "b+", "c+")]
    grammars.compile(specs[0]).result()
    assert grammars.compile(constrained(regex="a+")) is grammars.compile(specs[0])
    assert grammars.num_compiled == 1
    for spec in specs[1:]:
        grammars.compile(spec).result()
    grammars.compile(specs[0]).result()  # the least recently used, dropped for c+
    assert grammars.num_compiled == 4
    pids = [*grammars.worker_pids, grammars.server_pid]
    queued = grammars.compile(constrained(regex=slow_regex()))
    grammars.close()
    assert grammars.worker_pids == (None, None) and queued.done()
    deadline = time.monotonic() + 10  # a SIGKILLed process dies when the kernel gets to it, not at the call
    while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(gone(pid) for pid in pids)
    assert grammars.server_pid is None
    with pytest.raises(RuntimeError, match="closed"):
        grammars.compile(specs[1])


@pytest.mark.slow
def test_the_compile_process_dies_with_its_parent_even_mid_compile(tiny):
    script = f"""
import time
from transformers import AutoTokenizer
from executor.structured.grammars import Grammars
from shared.structured_outputs import StructuredOutputsParams as Spec
tokenizer = AutoTokenizer.from_pretrained({tiny!r})
grammars = Grammars(tokenizer, len(tokenizer), frozenset({{tokenizer.eos_token_id}}), timeout_s=600)
grammars.compile(Spec(regex="a+")).result()
grammars.compile(Spec(regex={slow_regex(80)!r}))  # minutes, niced: past the fast budget, on to the slow lane
while grammars.num_slow == 0 or grammars.worker_pids[1] is None:
    time.sleep(0.05)
print(grammars.worker_pids[1], grammars.server_pid, flush=True)
time.sleep(600)
"""
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        processes = [int(pid) for pid in parent.stdout.readline().split()]  # the slow lane's, the server
        time.sleep(1)  # into the compile
        assert not any(gone(pid) for pid in processes)
        os.kill(parent.pid, signal.SIGKILL)
        assert eventually(lambda: all(gone(pid) for pid in processes), timeout=10)
    finally:
        parent.kill()
        parent.wait()


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
    assert llm.stats().spec_draft_tokens > 0
    for out in outs:
        assert re.fullmatch("((ab|cd)+)?[ac]?", out.outputs[0].text), out.outputs[0].text


def test_without_the_grammar_library_a_structured_request_is_refused_naming_it(tiny_models, monkeypatch):
    """As on the GPU image, which has no xgrammar: the engine serves, and only a request that needs the library
    is refused, with a message saying which and how to install it."""
    from executor.structured import grammars

    monkeypatch.setattr(grammars, "_library_missing", ImportError("No module named 'xgrammar'"))
    llm = LLM(tiny_models["llama"], device="cpu", kv_cache_memory="8MiB")
    plain = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(
        ValueError, match=r"structured_outputs: .*No module named 'xgrammar'.*pip install xgrammar"
    ):
        llm.generate([[5, 6, 7]], constrained)
    assert len(llm.generate([[5, 6, 7]], plain)[0].outputs[0].token_ids) == 3
    assert not llm.engine.has_unfinished()
