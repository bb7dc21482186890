"""Greedy output must equal HF transformers token for token, whatever engine features are on; on float weights
(--quantization none: the default model is a GGUF that would otherwise serve its quantized blocks)."""

from __future__ import annotations

import pytest
import torch

from executor import LLM, SamplingParams
from tests.tiny_models import TINY_FAMILIES

MAX_NEW = 32
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
FLOAT = "none"

LONG_TEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed by rewiring panels; "
    "then came stored programs, assemblers, compilers, operating systems and virtual memory, each hiding the "
    "layer below so that people could think about larger problems. Virtual memory in particular let every "
    "program believe it owned a large contiguous address space, while the operating system mapped fixed-size "
    "pages onto whatever physical frames were free. "
)


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The reference: HF transformers generate, float32 on CPU, one prompt at a time, EOS not stopping it."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # otherwise generate() merges the model's EOS back in
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0)
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            outs.append(generated[0, len(prompt) :].tolist())
    return outs


def chat(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


@pytest.fixture(scope="module")
def default_prompts(default_model) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    texts = [
        "Hi",
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a land far away,",
        LONG_TEXT * 5 + "Summarize the text above in one sentence:",
    ]
    prompts = [tok.encode(t) for t in texts]
    prompts += [chat(tok, "What is the capital of France?"), chat(tok, "Write a haiku about memory paging.")]
    prompts.append(chat(tok, LONG_TEXT * 4 + "\nWhat did virtual memory let programs believe?"))
    assert len(prompts) >= 8 and max(len(p) for p in prompts) > 300
    return prompts


@pytest.fixture(scope="module")
def default_reference(default_model, default_prompts) -> list[list[int]]:
    return hf_greedy(default_model, default_prompts, MAX_NEW)


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def test_default_model_matches_hf(default_model, default_prompts, default_reference):
    llm = LLM(default_model, kv_cache_memory="256MiB", quantization=FLOAT)
    assert generate(llm, default_prompts) == default_reference
    assert llm.stats().kv_blocks_used == 0


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_random_models_match_hf(tiny_models, family):
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40, 150)]
    reference = hf_greedy(tiny_models[family], prompts, MAX_NEW)
    llm = LLM(tiny_models[family], kv_cache_memory="16MiB", max_num_batched_tokens=64)
    assert generate(llm, prompts) == reference


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(enable_prefix_caching=False),
        dict(enable_prefix_caching=True),
        dict(max_num_batched_tokens=7),
        dict(max_num_batched_tokens=16),
        dict(max_num_batched_tokens=64),
        dict(enable_chunked_prefill=False),
    ],
    ids=["no-prefix-cache", "prefix-cache", "chunk7", "chunk16", "chunk64", "unchunked"],
)
def test_engine_features_do_not_change_output(default_model, default_prompts, default_reference, engine_args):
    llm = LLM(default_model, kv_cache_memory="256MiB", quantization=FLOAT, **engine_args)
    # twice: the second round hits whatever the first left in the prefix cache
    assert generate(llm, default_prompts) == default_reference
    assert generate(llm, default_prompts) == default_reference
    stats = llm.stats()
    if engine_args.get("enable_prefix_caching", True):
        assert stats.prefix_cache_hit_tokens > 0
    else:
        assert stats.prefix_cache_hit_tokens == 0
    assert stats.kv_blocks_used == 0


def test_preemption_keeps_output(default_model, default_prompts, default_reference):
    # room for about two long requests at once: the others must be preempted and recomputed
    llm = LLM(
        default_model,
        kv_cache_memory=48 * 16 * 30 * 2 * 3 * 64 * 4,
        max_num_batched_tokens=256,
        quantization=FLOAT,
    )
    assert generate(llm, default_prompts) == default_reference
    assert llm.stats().preemptions > 0
    assert llm.stats().kv_blocks_used == 0


def test_all_at_once_equals_one_at_a_time(default_model, default_prompts, default_reference):
    llm = LLM(default_model, kv_cache_memory="256MiB", enable_prefix_caching=False, quantization=FLOAT)
    assert [generate(llm, [p])[0] for p in default_prompts] == default_reference
