"""Speculative decoding changes speed, never output: greedy runs equal the plain engine's token for token."""

from __future__ import annotations

import pytest

from executor import LLM, SamplingParams
from executor.scheduling.scheduler import SchedulerOutput
from executor.spec_decode import NgramProposer, SpecBackoff
from executor.spec_decode.backoff import MIN_ACCEPTANCE, PAUSE_STEPS
from tests.kv_blocks import assert_no_blocks_held
from tests.tiny_models import TINY_FAMILIES, save_tiny_model, tiny_config

MAX_NEW = 32
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
SPEC = dict(speculative_disable_by_batch_size=64)  # these tests exercise speculation, not its back-off
# The default model's quantized weights multiply float32 activations here. Verification rows attend with the
# prefill kernel, whose float32 sums round apart from the decode kernel's by ~1e-6; under int8 activations such a
# difference can move an activation across a rounding step, which shifts logits by the int8 rounding itself
# (~0.05 in a logprob) and flips near-ties. Exact greedy equality is a property of the float path.
DEFAULT = dict(kv_cache_memory="64MiB", max_model_len=1024, quantized_activations="float32")

CODE = '''def area(width, height):
    """Area of a rectangle."""
    result = width * height
    return result


def perimeter(width, height):
    result = 2 * (width + height)
    return result
'''


def generate(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


# -- the default model ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_prompts(default_model) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    texts = [
        CODE + "\nRewrite the code above with `result` renamed to `value`:\n",
        "The capital of France is",
        "Quote the sentence exactly: 'Virtual memory maps fixed-size pages onto physical frames.' Quote:",
        "Hi",
    ]
    return [tok.encode(t) for t in texts]


@pytest.fixture(scope="module")
def default_reference(default_model, default_prompts) -> list[list[int]]:
    return generate(LLM(default_model, **DEFAULT), default_prompts)


@pytest.mark.parametrize(
    "draft, k, extra",
    [
        ("ngram", 4, dict(max_num_batched_tokens=32)),  # verification rows share steps with prefill chunks
        ("tiny", 3, {}),
        ("self", 3, {}),
    ],
    ids=["ngram-chunked", "tiny-random-draft", "target-as-draft"],
)
def test_default_model_greedy_output_is_unchanged(
    default_model, tiny_models, default_prompts, default_reference, draft, k, extra
):
    model = {"ngram": "ngram", "tiny": tiny_models["llama"], "self": default_model}[draft]
    llm = LLM(
        default_model,
        **DEFAULT,
        speculative_model=model,
        num_speculative_tokens=k,
        **SPEC,
        **extra,
    )
    assert generate(llm, default_prompts) == default_reference
    stats = llm.stats()
    assert stats.spec_draft_tokens > 0
    if draft == "self":
        assert stats.spec_accepted_tokens == stats.spec_draft_tokens
        assert stats.spec_acceptance_rate == 1.0
    if draft == "ngram":  # the code rewrite repeats its prompt: lookup must find and land proposals
        assert stats.spec_accepted_tokens > 0
        # round two starts from the prefix cache, verified blocks only
        assert generate(llm, default_prompts) == default_reference
        assert llm.stats().prefix_cache_hit_tokens > 0
    assert_no_blocks_held(llm)


# -- tiny random models -----------------------------------------------------------------------------------

TINY_PROMPTS = [list(range(5, 5 + n)) for n in (3, 17, 40)] + [[7, 8, 9, 10] * 12]


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_models_greedy_output_is_unchanged(tiny_models, family):
    """Off, n-gram, another tiny random model as draft, and the target as its own draft (accepting all)."""
    path = tiny_models[family]
    args = dict(kv_cache_memory="8MiB", max_num_batched_tokens=64)
    reference = generate(LLM(path, **args), TINY_PROMPTS)
    other = tiny_models["qwen2" if family != "qwen2" else "llama"]
    for draft, k in (("ngram", 5), (other, 3), (path, 4)):
        llm = LLM(path, speculative_model=draft, num_speculative_tokens=k, **args, **SPEC)
        assert generate(llm, TINY_PROMPTS) == reference, draft
        stats = llm.stats()
        # (a random model's output need not repeat anything, so n-gram lookup may find nothing to propose)
        assert stats.spec_draft_tokens > 0 or draft == "ngram"
        if draft == path:
            assert stats.spec_acceptance_rate == 1.0
        assert_no_blocks_held(llm)


# -- edge cases ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_models) -> str:
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def self_draft(tiny) -> LLM:
    """The tiny model drafting for itself: every proposal is accepted, so runs are always k + 1 long."""
    return LLM(tiny, kv_cache_memory="8MiB", speculative_model=tiny, num_speculative_tokens=6, **SPEC)


@pytest.fixture(scope="module")
def tiny_reference(tiny) -> list[int]:
    return generate(LLM(tiny, kv_cache_memory="8MiB"), [[3, 4, 5]])[0]


def test_k_larger_than_the_tokens_left_to_max_tokens(self_draft, tiny_reference):
    for max_tokens in (1, 2, 3, 9):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        out = self_draft.generate([[3, 4, 5]], params)[0].outputs[0]
        assert out.token_ids == tiny_reference[:max_tokens] and out.finish_reason == "length"
    assert_no_blocks_held(self_draft)


def test_k_larger_than_the_room_left_in_max_model_len(tiny, tiny_reference):
    llm = LLM(
        tiny, kv_cache_memory="8MiB", max_model_len=12, speculative_model="ngram", num_speculative_tokens=8
    )
    prompt = [3, 4, 5, 3, 4, 5, 3, 4, 5]  # n-gram lookup proposes plenty
    out = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0].outputs[0]
    reference = generate(LLM(tiny, kv_cache_memory="8MiB", max_model_len=12), [prompt], out_params(3))[0]
    assert out.token_ids == reference and len(out.token_ids) == 3
    assert_no_blocks_held(llm)


def out_params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_a_stop_token_inside_an_accepted_run_ends_the_output_there(self_draft, tiny_reference):
    stop = tiny_reference[8]  # the 2nd run of 7 covers tokens 1..7, the 3rd 8..14
    first = tiny_reference.index(stop)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, stop_token_ids=[stop])
    out = self_draft.generate([[3, 4, 5]], params)[0].outputs[0]
    assert out.token_ids == tiny_reference[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert_no_blocks_held(self_draft)


def test_a_stop_string_inside_an_accepted_run_ends_the_tokens_there_too(tiny, self_draft):
    plain = LLM(tiny, kv_cache_memory="8MiB")
    full = plain.generate([[3, 4, 5]], SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))[0]
    text = full.outputs[0].text
    stop = text[len(text) // 3 : len(text) // 3 + 3]
    assert stop and stop not in text[: len(text) // 3]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, stop=[stop])
    expected = plain.generate([[3, 4, 5]], params)[0].outputs[0]
    out = self_draft.generate([[3, 4, 5]], params)[0].outputs[0]
    assert (out.text, out.token_ids, out.stop_reason) == (expected.text, expected.token_ids, stop)
    assert len(out.token_ids) < MAX_NEW
    assert_no_blocks_held(self_draft)


def test_eos_inside_an_accepted_run_ends_the_output_there(tiny, tiny_reference):
    llm = LLM(tiny, kv_cache_memory="8MiB", speculative_model=tiny, num_speculative_tokens=6)
    eos = tiny_reference[9]
    llm.engine.intake.eos_token_ids = frozenset({eos})  # what new requests stop at
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=MAX_NEW, temperature=0))[0].outputs[0]
    assert out.token_ids == tiny_reference[: tiny_reference.index(eos) + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert llm.stats().spec_accepted_tokens > 0
    assert_no_blocks_held(llm)


def test_preemption_under_memory_pressure_keeps_output(tiny):
    prompts = [list(range(10 + i, 70 + i)) for i in range(6)]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    reference = generate(LLM(tiny, kv_cache_memory="8MiB"), prompts, params)
    # 24 blocks of 16 tokens: room for about three of the six requests at once
    block_bytes = (
        2 * 2 * 16 * 2 * 16 * 4
    )  # target and draft, each 2 layers x K,V x 16 slots x 2 heads x 16 dims
    llm = LLM(
        tiny, kv_cache_memory=24 * 2 * block_bytes, speculative_model=tiny, num_speculative_tokens=4, **SPEC
    )
    assert llm.stats().kv_blocks_total == 24
    assert generate(llm, prompts, params) == reference
    stats = llm.stats()
    assert stats.preemptions > 0 and stats.spec_accepted_tokens > 0
    assert_no_blocks_held(llm)


@pytest.mark.parametrize("draft", ["ngram", "self"])
def test_preempting_a_request_with_pending_proposals(tiny, draft):
    """Preempted between proposing and verifying: its proposals go, it recomputes, and its output stays."""
    prompts = [[7, 8, 9, 10] * 6, list(range(20, 50))]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    reference = generate(LLM(tiny, kv_cache_memory="8MiB"), prompts, params)
    model = "ngram" if draft == "ngram" else tiny
    llm = LLM(tiny, kv_cache_memory="8MiB", speculative_model=model, num_speculative_tokens=3, **SPEC)
    ids = [llm.add_request(p, params) for p in prompts]
    victim = llm.engine.intake.requests[ids[1]] if draft == "self" else llm.engine.intake.requests[ids[0]]
    outputs = {i: [] for i in ids}
    preempted = False
    while llm.engine.has_unfinished():
        for out in llm.step():
            outputs[out.request_id] = out.outputs[0].token_ids
        if not preempted and victim.spec_token_ids and victim.num_output_tokens > 8:
            llm.engine.scheduler._preempt(
                victim, SchedulerOutput()
            )  # as the scheduler does when blocks run out
            preempted = True
            assert not victim.spec_token_ids
    assert preempted and llm.stats().preemptions == 1
    assert [outputs[i] for i in ids] == reference
    assert_no_blocks_held(llm)


def test_rejected_proposals_never_reach_the_prefix_cache(tiny, tiny_models):
    """Round one rejects most proposals. Round two reuses round one's cached blocks,
    outputs included; a block holding a rejected token's KV would change its output."""
    prompts = [[7, 8, 9, 10] * 5 + [i] for i in range(3, 7)]
    other = tiny_models["qwen2"]  # another random model: its proposals are mostly rejected
    llm = LLM(tiny, kv_cache_memory="8MiB", speculative_model=other, num_speculative_tokens=5, **SPEC)
    first = generate(llm, prompts)
    stats = llm.stats()
    assert stats.spec_draft_tokens > stats.spec_accepted_tokens
    follow_up = [p + out for p, out in zip(prompts, first, strict=True)]
    plain = LLM(tiny, kv_cache_memory="8MiB", enable_prefix_caching=False)
    assert generate(llm, follow_up) == generate(plain, follow_up)
    assert llm.stats().prefix_cache_hit_tokens - stats.prefix_cache_hit_tokens >= 4 * 32
    assert_no_blocks_held(llm)


def test_every_sampling_option_with_speculation(tiny):
    """Seeded sampling is reproducible, logprobs come for every token, penalties and filters all apply (the
    draft knows nothing of penalties, so verification must apply them at every position)."""
    llm = LLM(tiny, kv_cache_memory="8MiB", speculative_model=tiny, num_speculative_tokens=4, **SPEC)
    prompt = [7, 8, 9, 10] * 8
    options = dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.01, presence_penalty=0.2, logprobs=2)
    params = SamplingParams(max_tokens=24, seed=5, ignore_eos=True, **options)
    first, second = (llm.generate([prompt], params)[0].outputs[0] for _ in range(2))
    assert first.token_ids == second.token_ids and len(first.token_ids) == 24
    assert len(first.logprobs) == 24 and [lp.token_id for lp in first.logprobs] == first.token_ids
    greedy = SamplingParams(
        max_tokens=24,
        temperature=0,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        logit_bias={7: 4.0, 8: -4.0},
        ignore_eos=True,
    )
    plain = LLM(tiny, kv_cache_memory="8MiB")
    assert generate(llm, [prompt], greedy) == generate(plain, [prompt], greedy)
    assert llm.stats().spec_draft_tokens > 0
    assert_no_blocks_held(llm)


def test_stats_and_per_request_accepted_counts(tiny):
    llm = LLM(tiny, kv_cache_memory="8MiB", speculative_model=tiny, num_speculative_tokens=3, **SPEC)
    outs = llm.generate([[3, 4, 5], [6, 7]], GREEDY)
    stats = llm.stats()
    # 1 token from the prefill, then runs of 4 up to 29; with 3 left, k shrinks to 2: 7 x 3 + 2 accepted
    assert [o.num_accepted_tokens for o in outs] == [23, 23]
    assert stats.spec_draft_tokens == stats.spec_accepted_tokens == 46


# -- back-off -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("draft", ["ngram", "self"])
def test_no_speculation_while_the_batch_is_large(tiny, draft):
    """Over the batch limit nothing is proposed, and a draft model does not even run."""
    model = "ngram" if draft == "ngram" else tiny
    llm = LLM(
        tiny,
        kv_cache_memory="8MiB",
        speculative_model=model,
        num_speculative_tokens=4,
        speculative_disable_by_batch_size=3,
    )
    draft_runs = []
    if llm.engine.draft is not None:
        run = llm.engine.draft.runner.run
        llm.engine.draft.runner.run = lambda chunks: draft_runs.append(len(chunks)) or run(chunks)
    prompts = [[7, 8, 9, 10] * 6 + [i] for i in range(4)]
    generate(llm, prompts)  # four running, all to the end
    assert llm.stats().spec_draft_tokens == 0 and not draft_runs
    generate(llm, prompts[:3])
    assert llm.stats().spec_draft_tokens > 0
    assert draft_runs or draft == "ngram"


def test_low_acceptance_pauses_a_request_then_lets_it_try_again():
    backoff = SpecBackoff(max_batch=8)
    backoff.record("a", 4, 4)
    assert backoff.request_allows("a")
    for _ in range(10):
        backoff.record("a", 4, 0)
        if not backoff.request_allows("a"):
            break
    assert sum(not backoff.request_allows("a") for _ in range(3 * PAUSE_STEPS)) == PAUSE_STEPS - 1
    assert backoff.request_allows("b")  # others are not affected
    backoff.record("a", 4, 0)
    backoff.record("a", 4, 0)  # falls again: twice as long a pause
    assert sum(not backoff.request_allows("a") for _ in range(4 * PAUSE_STEPS)) == 2 * PAUSE_STEPS
    assert MIN_ACCEPTANCE > 0


# -- n-gram lookup -------------------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_longest_recent_match():
    ngram = NgramProposer(min_n=1, max_n=3)
    # "1 2 3" occurred at the start, followed by 4 5 6; "2 3" alone also later, followed by 9
    assert ngram.propose([1, 2, 3, 4, 5, 6, 7, 2, 3, 9, 1, 2, 3], 3) == [4, 5, 6]
    assert ngram.propose([5, 1, 8, 2, 1], 2) == [8, 2]  # one-token match
    assert ngram.propose([1, 2, 3, 4], 3) == []  # nothing repeats
    assert ngram.propose([1, 2, 1, 2, 1], 3) == [2, 1]  # the most recent match: what follows is cut short
    assert NgramProposer(min_n=2, max_n=3).propose([5, 1, 8, 2, 1], 2) == []  # match shorter than min_n


# -- configuration -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        (dict(speculative_model="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
        (
            dict(
                speculative_model="ngram", num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=2
            ),
            "prompt_lookup_max",
        ),
        (dict(speculative_model="ngram", num_speculative_tokens=2, prompt_lookup_min=0), "prompt_lookup_min"),
        (dict(speculative_model="/no/such/draft", num_speculative_tokens=2), "speculative_model"),
    ],
)
def test_bad_speculative_config_names_the_flag(tiny, kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        LLM(tiny, kv_cache_memory="8MiB", **kwargs)


def test_a_draft_with_another_vocabulary_is_refused_at_start(tiny, tmp_path):
    from transformers import AutoTokenizer

    save_tiny_model(tmp_path, tiny_config("llama", vocab_size=1000), AutoTokenizer.from_pretrained(tiny))
    with pytest.raises(ValueError, match="speculative_model: the draft's vocabulary"):
        LLM(tiny, kv_cache_memory="8MiB", speculative_model=str(tmp_path), num_speculative_tokens=2)
