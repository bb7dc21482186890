"""Engine behaviour a user notices: refusals, aborts, stops, seeds, logprobs, and blocks always coming back."""

from __future__ import annotations

import pytest
import torch

from executor import LLM, SamplingParams
from shared.tenant import Tenant
from tests.kv_blocks import assert_no_blocks_held


@pytest.fixture(scope="module")
def llm(tiny_models) -> LLM:
    return LLM(tiny_models["llama"], kv_cache_memory="4MiB", max_num_batched_tokens=64, max_model_len=512)


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ("", SamplingParams(), "prompt"),
        ([], SamplingParams(), "prompt"),
        ([1, 2, 10**7], SamplingParams(), "prompt_token_ids"),
        ([1, -1], SamplingParams(), "prompt_token_ids"),
        (list(range(1, 500)), SamplingParams(max_tokens=100), "prompt"),  # over max_model_len
        ([1, 2], SamplingParams(logit_bias={10**7: 5}), "logit_bias"),
    ],
)
def test_bad_requests_are_refused_naming_the_field_and_others_go_on(llm, prompt, params, field):
    good = llm.add_request([5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    with pytest.raises(ValueError, match=field):
        llm.add_request(prompt, params)
    finished = []
    while llm.engine.has_unfinished():
        finished += [o for o in llm.step() if o.finished]
    assert [o.request_id for o in finished] == [good] and len(finished[0].outputs[0].token_ids) == 4
    assert_no_blocks_held(llm)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_a_request_larger_than_the_whole_pool_is_refused(tiny_models):
    small = LLM(tiny_models["llama"], kv_cache_memory=4 * 2 * 2 * 16 * 2 * 16 * 4, max_model_len=512)
    assert small.stats().kv_blocks_total == 4
    with pytest.raises(ValueError, match="whole pool"):
        small.generate([list(range(1, 60))], SamplingParams(max_tokens=10))
    out = small.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 5
    assert_no_blocks_held(small)


def test_generate_refuses_a_bad_batch_whole_and_leaks_nothing(llm):
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([[1, 2, 3], [4, 10**9]], SamplingParams(max_tokens=3))
    assert_no_blocks_held(llm)


def test_abort_frees_blocks_and_leaves_neighbours_running(llm):
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    keep = llm.add_request(list(range(10, 60)), params)
    drop = llm.add_request(list(range(100, 160)), params)
    llm.step()
    llm.step()
    assert llm.stats().kv_blocks_used > 0
    llm.abort(drop)
    done = []
    while llm.engine.has_unfinished():
        done += [o.request_id for o in llm.step() if o.finished]
    assert done == [keep]
    assert_no_blocks_held(llm)


def test_max_tokens_and_stop_token_ids_end_requests(llm):
    free = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    ids = free.outputs[0].token_ids
    assert len(ids) == 12 and free.outputs[0].finish_reason == "length"
    stopped = llm.generate(
        [[1, 2, 3]], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[ids[4]])
    )[0]
    first = ids.index(ids[4])
    assert stopped.outputs[0].token_ids == ids[: first + 1]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == ids[4]


def test_stop_strings_trim_text_and_end_the_request(llm):
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    full = llm.generate([[1, 2, 3]], params)[0].outputs[0]
    stop = full.text[5:9]
    assert stop and stop not in full.text[:5]
    out = llm.generate(
        [[1, 2, 3]], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop])
    )
    completion = out[0].outputs[0]
    assert completion.text == full.text[: full.text.index(stop)]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert len(completion.token_ids) < 20
    assert_no_blocks_held(llm)


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate([[1, 2, 3]], seeded)[0].outputs[0].token_ids
    noisy = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    crowd = llm.generate([[7, 8], [1, 2, 3], [9, 9, 9, 9]], [noisy, seeded, noisy])
    assert crowd[1].outputs[0].token_ids == alone
    other = llm.generate(
        [[1, 2, 3]], SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True)
    )
    assert other[0].outputs[0].token_ids != alone


def test_logprobs_are_the_models_own(llm, tiny_models):
    from transformers import AutoModelForCausalLM

    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, temperature=0, logprobs=3))[0].outputs[0]
    (entry,) = out.logprobs
    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    with torch.inference_mode():
        reference = model(torch.tensor([[1, 2, 3]])).logits[0, -1].log_softmax(-1)
    top = reference.topk(3)
    assert entry.token_id == out.token_ids[0] == top.indices[0].item() and entry.rank == 1
    assert [t for t, _ in entry.top] == top.indices.tolist()
    assert [lp for _, lp in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_logit_bias_forces_and_bans_tokens(llm):
    prompt = [5, 6, 7, 8]
    greedy = dict(max_tokens=6, temperature=0, ignore_eos=True)
    plain = llm.generate([prompt], SamplingParams(**greedy))[0].outputs[0].token_ids
    forced = llm.generate([prompt], SamplingParams(**greedy, logit_bias={"42": 100}))[0].outputs[0].token_ids
    assert forced == [42] * 6
    banned = SamplingParams(**greedy, logit_bias={t: -100 for t in plain})
    assert not set(llm.generate([prompt], banned)[0].outputs[0].token_ids) & set(plain)
    assert_no_blocks_held(llm)


def test_shared_prefix_is_served_from_cache(llm):
    prefix = list(range(200, 264))
    params = SamplingParams(max_tokens=2, temperature=0)
    first = llm.generate([prefix + [1, 2]], params)[0]
    second = llm.generate([prefix + [3, 4]], params)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 64
    assert_no_blocks_held(llm)


def test_token_and_text_prompts_agree(llm):
    ids = llm.tokenizer.encode("hello world")
    params = SamplingParams(max_tokens=5, temperature=0)
    by_text, by_ids = llm.generate(["hello world", ids], params)
    assert by_text.prompt_token_ids == ids and by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids


def test_a_sliding_window_bounds_max_model_len(tiny_models):
    assert LLM(tiny_models["mistral"], kv_cache_memory="4MiB").engine.max_model_len == 512
    with pytest.raises(ValueError, match="sliding window"):
        LLM(tiny_models["mistral"], kv_cache_memory="4MiB", max_model_len=1000)


def test_load_counts_the_prompt_tokens_still_to_prefill(llm):
    """What routing weighs: the prefill work a new request would wait behind."""
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    # prompts no other test sends, so no prefix hit; 100 tokens take two steps at a 64-token budget
    first = llm.add_request(list(range(4200, 4300)), params)
    second = llm.add_request(list(range(4300, 4340)), params)
    assert llm.engine.stats().prefill_tokens == 140
    llm.step()  # the first 64 of the first prompt
    assert llm.engine.stats().prefill_tokens == 76
    while llm.engine.has_unfinished():
        llm.step()
    assert llm.engine.stats().prefill_tokens == 0
    assert {first, second} and llm.engine.stats().running == 0


def test_load_reports_the_most_requests_one_tenant_has_waiting(llm):
    """The gateway counts each tenant's places from it; a tenant's weight must be positive to share by."""
    engine, params = llm.engine, SamplingParams(max_tokens=1, temperature=0)
    for i in range(3):
        engine.add_request(f"wa{i}", [5, 6, 7 + i], params, Tenant("A", "a-salt"))
    engine.add_request("wb", [5, 6, 9], params, Tenant("B", "b-salt", 2.5))
    assert (engine.stats().waiting, engine.stats().waiting_max_tenant) == (4, 3)
    with pytest.raises(ValueError, match="weight"):
        engine.add_request("w0", [5, 6], params, Tenant("C", "c-salt", 0))
    while engine.has_unfinished():
        llm.step()
    assert engine.stats().waiting_max_tenant == 0
    assert_no_blocks_held(llm)


def test_a_steps_token_budget_defaults_by_device(tiny_models):
    """512 on a CPU, where a 2,048-token step would take seconds; an explicit budget is kept."""
    from executor.engine_config import EngineConfig

    assert LLM(tiny_models["llama"], kv_cache_memory="1MiB").engine.config.max_num_batched_tokens == 512
    assert EngineConfig().resolved("cuda", 8192).max_num_batched_tokens == 2048
    assert EngineConfig(max_num_batched_tokens=96).resolved("cpu", 8192).max_num_batched_tokens == 96
