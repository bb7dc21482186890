"""Prompt logprobs (SamplingParams.prompt_logprobs): HF's log-softmax at every prompt position, whatever the chunks
and whatever the prefix cache holds."""

from __future__ import annotations

import pytest
import torch

from executor import LLM, SamplingParams
from executor.sampling import step_sampler
from tests.executor.test_hf_equivalence import LONG_TEXT

TOP = 5
# HF's float32 reference: the default model's quantized weights multiply float32 activations, which gives the
# dequantized model's logprobs to float32 rounding (int8 activations are a further approximation)
FLOAT_PATH = dict(kv_cache_memory="64MiB", quantized_activations="float32")


@pytest.fixture(scope="module")
def prompt(default_model) -> list[int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(default_model).encode(LONG_TEXT)
    assert len(ids) > 70  # several 7- and 64-token chunks, and a few 16-token blocks
    return ids


@pytest.fixture(scope="module")
def hf_logprobs(default_model, prompt) -> torch.Tensor:
    """[len(prompt) - 1, V]: row i is the float32 log-softmax that scores prompt token i + 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def check_against_hf(entries, prompt: list[int], reference: torch.Tensor) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for position, entry in enumerate(entries[1:], start=1):
        row = reference[position - 1]
        assert entry.token_id == prompt[position]
        assert abs(entry.logprob - row[prompt[position]].item()) < 1e-4, position
        assert entry.rank == int((row > row[prompt[position]]).sum()) + 1
        best_logprobs, best_ids = row.topk(TOP)
        assert [t for t, _ in entry.top] == best_ids.tolist(), position
        assert (
            max(abs(lp - ref) for (_, lp), ref in zip(entry.top, best_logprobs.tolist(), strict=True)) < 1e-4
        )


@pytest.mark.parametrize("budget", [7, 64])
def test_prompt_logprobs_match_hf_in_chunks(default_model, prompt, hf_logprobs, budget):
    llm = LLM(default_model, **FLOAT_PATH, max_num_batched_tokens=budget)
    out = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=TOP))[0]
    check_against_hf(out.prompt_logprobs, prompt, hf_logprobs)
    assert len(out.outputs[0].token_ids) == 3
    # a request that did not ask gets none, in the same batch or alone
    plain = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert plain.prompt_logprobs is None
    assert plain.outputs[0].token_ids == out.outputs[0].token_ids


def test_prompt_logprobs_scored_a_slice_of_rows_at_a_time(default_model, prompt, hf_logprobs, monkeypatch):
    """A step's logits are bounded: a chunk's prompt rows are scored PROMPT_LOGITS_ROWS at a time."""
    monkeypatch.setattr(step_sampler, "PROMPT_LOGITS_ROWS", 10)  # 64-row chunks in slices of 10, and a rest
    llm = LLM(default_model, **FLOAT_PATH, max_num_batched_tokens=64)
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOP))[0]
    check_against_hf(out.prompt_logprobs, prompt, hf_logprobs)


def test_prompt_logprobs_with_a_cached_prefix(default_model, prompt, hf_logprobs):
    """A cached block has KV but no logits: the request recomputes its prompt, and its blocks serve others."""
    llm = LLM(default_model, **FLOAT_PATH, max_num_batched_tokens=64)
    llm.generate([prompt[:40]], SamplingParams(max_tokens=1, temperature=0.0))  # caches 2 of 16-token blocks
    scored = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOP))[0]
    check_against_hf(scored.prompt_logprobs, prompt, hf_logprobs)
    assert scored.num_cached_tokens == 0
    again = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert again.num_cached_tokens == (len(prompt) - 1) // 16 * 16


def test_max_tokens_zero_scores_the_prompt_only(default_model, prompt, hf_logprobs):
    llm = LLM(default_model, **FLOAT_PATH, max_num_batched_tokens=32)
    out = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=TOP))[0]
    check_against_hf(out.prompt_logprobs, prompt, hf_logprobs)
    assert out.outputs[0].token_ids == [] and out.outputs[0].text == ""
    assert out.outputs[0].finish_reason == "length"
    assert llm.stats().kv_blocks_used == 0


def test_prompt_logprobs_bounds():
    with pytest.raises(ValueError, match="prompt_logprobs must be in \\[0, 20\\]"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        SamplingParams(max_tokens=0)
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0


def test_prompt_logprobs_survive_preemption(tiny_models):
    """Preempted requests (some mid-prefill) recompute: their prompt logprobs are those of a run alone, each
    position once."""
    prompts = [list(range(start, start + 60)) for start in (5, 300, 900)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    alone = LLM(tiny_models["llama"], kv_cache_memory="4MiB")
    expected = [alone.generate([p], params)[0] for p in prompts]
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 KV heads of 16, float32
    tight = LLM(tiny_models["llama"], kv_cache_memory=12 * block_bytes, max_num_batched_tokens=16)
    outs = tight.generate(prompts, params)
    assert tight.stats().preemptions > 0
    for out, want in zip(outs, expected, strict=True):
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        assert len(out.prompt_logprobs) == len(want.prompt_logprobs) == 60
        for got, ref in zip(out.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
            assert (got.token_id, got.rank) == (ref.token_id, ref.rank)
            assert abs(got.logprob - ref.logprob) < 1e-4
