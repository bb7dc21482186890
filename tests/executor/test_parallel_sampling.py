"""Parallel sampling (n > 1) offline: one prefill, prompt blocks shared by the choices, each choice its own."""

from __future__ import annotations

import pytest

from executor import LLM, SamplingParams
from shared.sampling_params import MAX_N
from tests.kv_blocks import assert_no_blocks_held

GREEDY = dict(temperature=0, ignore_eos=True)
BLOCK = 16


def make_llm(tiny_models, **kwargs) -> LLM:
    args = dict(kv_cache_memory="4MiB", max_num_batched_tokens=64, max_model_len=512) | kwargs
    return LLM(tiny_models["llama"], **args)


@pytest.fixture(scope="module")
def llm(tiny_models) -> LLM:
    return make_llm(tiny_models)


def choices(llm: LLM, prompt, **params) -> list[list[int]]:
    out = llm.generate([prompt], SamplingParams(**params))[0]
    assert [c.index for c in out.outputs] == list(range(params.get("n", 1)))
    return [c.token_ids for c in out.outputs]


@pytest.mark.parametrize("prompt_len", [37, 48])  # a partial last block (copied) and whole blocks only
@pytest.mark.parametrize("caching", [True, False])
def test_n4_greedy_gives_four_copies_of_the_n1_output(tiny_models, prompt_len, caching):
    llm = make_llm(tiny_models, enable_prefix_caching=caching)
    prompt = list(range(100, 100 + prompt_len))
    single = choices(llm, prompt, max_tokens=24, **GREEDY)
    assert choices(llm, prompt, max_tokens=24, n=4, **GREEDY) == single * 4
    assert_no_blocks_held(llm)


def test_the_prompt_is_prefilled_once_and_its_full_blocks_shared(tiny_models):
    llm = make_llm(tiny_models, enable_prefix_caching=False, max_num_batched_tokens=256)
    prompt = list(range(100, 100 + 5 * BLOCK + 3))  # 5 full blocks and 3 tokens in a sixth
    llm.add_request(prompt, SamplingParams(max_tokens=8, n=4, **GREEDY))
    llm.step()  # the prefill: 83 tokens computed once, four first tokens
    assert llm.stats().kv_blocks_used == 6
    llm.step()  # each choice writes its second token: three copy the shared partial block, one keeps it
    assert llm.stats().kv_blocks_used == 5 + 4
    # the five shared blocks once, and each choice's own last block: the prompt's 3 tokens and its first
    assert llm.engine.kv_tokens_stored() == 5 * BLOCK + 4 * (3 + 1)
    while llm.engine.has_unfinished():
        llm.step()
    assert_no_blocks_held(llm)


def test_a_seeded_request_is_reproducible_and_its_choices_differ(llm):
    prompt = list(range(200, 230))
    params = dict(max_tokens=16, n=4, temperature=1.0, seed=1234, ignore_eos=True)
    first = choices(llm, prompt, **params)
    assert choices(llm, prompt, **params) == first
    assert len({tuple(c) for c in first}) == 4
    # choice 0 draws from the request's own seed: the same as n=1
    assert first[0] == choices(llm, prompt, max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)[0]


def test_unseeded_choices_differ(llm):
    out = choices(llm, list(range(300, 320)), max_tokens=16, n=4, temperature=1.0, ignore_eos=True)
    assert len({tuple(c) for c in out}) == 4


# penalties read each choice's own output, which survives preemption: shared or lost counts would show
PENALTIES = dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2, logit_bias={60: 2.0})


@pytest.mark.parametrize("penalties", [{}, PENALTIES], ids=["plain", "penalties"])
def test_a_group_under_a_tiny_pool_is_preempted_and_still_gives_the_greedy_output(tiny_models, penalties):
    # 16 blocks: the group needs 2 shared + 4 x 3 of its own at its end, the other request 5: they preempt
    llm = make_llm(tiny_models, kv_cache_memory=16 * 2 * 2 * BLOCK * 2 * 16 * 4)
    assert llm.stats().kv_blocks_total == 16
    prompts = [list(range(50, 90)), list(range(150, 190))]
    greedy = GREEDY | penalties
    singles = [choices(llm, p, max_tokens=40, **greedy)[0] for p in prompts]
    outs = llm.generate(
        prompts, [SamplingParams(max_tokens=40, n=4, **greedy), SamplingParams(max_tokens=40, **greedy)]
    )
    assert [c.token_ids for c in outs[0].outputs] == [singles[0]] * 4
    assert outs[1].outputs[0].token_ids == singles[1]
    assert llm.stats().preemptions > 0
    assert_no_blocks_held(llm)


def test_aborting_the_group_frees_every_choice(llm):
    request_id = llm.add_request(list(range(10, 60)), SamplingParams(max_tokens=60, n=4, **GREEDY))
    for _ in range(4):
        llm.step()
    assert llm.stats().running == 4
    llm.abort(request_id)
    assert_no_blocks_held(llm)


def test_aborting_before_the_prefill_ends_frees_the_choices_waiting_to_fork(llm):
    request_id = llm.add_request(list(range(10, 200)), SamplingParams(max_tokens=8, n=4, **GREEDY))
    llm.step()  # a first chunk of 64 tokens
    assert llm.stats().running == 1
    llm.abort(request_id)
    assert_no_blocks_held(llm)


def test_stop_strings_and_logprobs_work_per_choice(llm):
    tokenizer = llm.tokenizer
    prompt = list(range(400, 420))
    free = llm.generate(
        [prompt], SamplingParams(max_tokens=24, n=3, temperature=1.0, seed=7, ignore_eos=True)
    )
    texts = [c.text for c in free[0].outputs]
    stop = texts[1][len(texts[1]) // 2 :][:3]  # a piece of choice 1's text; the others may not contain it
    assert stop
    out = llm.generate(
        [prompt],
        SamplingParams(max_tokens=24, n=3, temperature=1.0, seed=7, stop=stop, logprobs=2, ignore_eos=True),
    )[0]
    for free_text, choice in zip(texts, out.outputs, strict=True):
        if stop in free_text:
            assert choice.text == free_text[: free_text.index(stop)] and choice.finish_reason == "stop"
            assert choice.stop_reason == stop
        else:
            assert choice.text == free_text and choice.finish_reason == "length"
        assert len(choice.logprobs) == len(choice.token_ids)
        assert [lp.token_id for lp in choice.logprobs] == choice.token_ids
        assert tokenizer.decode(choice.token_ids).startswith(choice.text[:1])
    assert_no_blocks_held(llm)


@pytest.mark.parametrize("draft", ["ngram", "model"])
def test_speculative_decoding_works_per_choice(tiny_models, draft):
    # the model drafting for itself: its proposals are all accepted, and its own KV is copied on write too
    model = "ngram" if draft == "ngram" else tiny_models["llama"]
    llm = make_llm(
        tiny_models, speculative_model=model, num_speculative_tokens=3, speculative_disable_by_batch_size=8
    )
    prompt = [5, 6, 7, 8] * 10 + [5]
    single = choices(llm, prompt, max_tokens=30, **GREEDY)
    drafted = llm.stats().spec_draft_tokens
    assert choices(llm, prompt, max_tokens=30, n=4, **GREEDY) == single * 4
    # n-gram lookup proposes only where the random model's output repeats itself, which it may never do
    assert llm.stats().spec_draft_tokens > 2 * drafted > 0 or draft == "ngram"
    assert_no_blocks_held(llm)


def test_the_prefix_cache_serves_a_later_group(tiny_models):
    llm = make_llm(tiny_models)
    prompt = list(range(600, 650))
    first = llm.generate([prompt], SamplingParams(max_tokens=8, n=3, **GREEDY))[0]
    again = llm.generate([prompt], SamplingParams(max_tokens=8, n=3, **GREEDY))[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 48
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in first.outputs]


def test_n_out_of_range_is_refused_naming_n(tiny_models):
    for bad in (0, MAX_N + 1, True, "2"):
        with pytest.raises(ValueError, match="^n "):
            SamplingParams(n=bad)
    llm = make_llm(tiny_models, max_num_seqs=4)
    with pytest.raises(ValueError, match="^n: 5 choices exceed this executor's max_num_seqs 4"):
        llm.generate([[1, 2, 3]], SamplingParams(n=5))
    small = make_llm(tiny_models, kv_cache_memory=12 * 2 * 2 * BLOCK * 2 * 16 * 4)
    with pytest.raises(ValueError, match="n 8 x max_tokens 64 need more KV blocks than the whole pool"):
        small.generate([list(range(1, 40))], SamplingParams(n=8, max_tokens=64))
    assert_no_blocks_held(small)


def test_structured_outputs_constrain_every_choice(llm):
    words = ["alpha", "beta", "gamma", "delta"]
    params = SamplingParams(
        max_tokens=10, n=6, temperature=1.0, seed=11, structured_outputs={"choice": words}
    )
    out = llm.generate([[1, 2, 3]], params)[0]
    assert all(c.text in words and c.finish_reason == "stop" for c in out.outputs)
    assert len({c.text for c in out.outputs}) > 1  # each choice's own matcher, not one shared
    assert_no_blocks_held(llm)


def test_aborting_one_choice_leaves_the_others_running(llm):
    engine = llm.engine
    engine.add_request("cut", list(range(10, 40)), SamplingParams(max_tokens=20, n=3, **GREEDY))
    engine.step()
    assert engine.abort("cut", 1) == [1]
    assert engine.abort("cut", 1) == []  # already stopped
    outs = []
    while engine.has_unfinished():
        outs += engine.step().outputs
    assert {o.index for o in outs} == {0, 2} and all(len(o.new_token_ids) == 1 for o in outs)
    assert sum(o.group_finished for o in outs) == 1 and outs[-1].group_finished
    assert_no_blocks_held(llm)
