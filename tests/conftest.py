"""Shared fixtures: the default model (pulled once) and tiny random-weight models of each family."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(2)

TINY_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


@pytest.fixture(scope="session")
def default_model() -> str:
    from executor.model_files import resolve_model

    return str(resolve_model(None))


def _tiny_config(family: str, vocab_size: int):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        max_position_embeddings=1024,
        initializer_range=0.4,  # peaked logits: greedy comparisons should not hinge on near-ties
        tie_word_embeddings=family != "llama",
    )
    if family == "llama":
        scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
        return LlamaConfig(**common, rope_scaling={**scaling, "original_max_position_embeddings": 64})
    if family == "mistral":
        return MistralConfig(**common, sliding_window=512)
    if family == "qwen2":
        return Qwen2Config(**common)
    return Qwen3Config(**common, head_dim=32)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, default_model) -> dict[str, str]:
    """family -> directory of a tiny random model saved as safetensors, with the default model's tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model)
    out = {}
    for family in TINY_FAMILIES:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_tiny_config(family, len(tokenizer)), dtype=torch.float32)
        path = tmp_path_factory.mktemp(f"tiny-{family}")
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        out[family] = str(path)
    return out


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


@pytest.fixture(scope="session")
def redis_url():
    """A real Redis-protocol server (kvserve.redis_server) for the whole session, stopped by its own PID."""
    from kvserve.redis_server import start_redis_server

    server = start_redis_server()
    yield server.url
    server.stop()
