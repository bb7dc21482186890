"""Tiny random-weight models of each family the executor serves: fast to build and to run, and with the shapes
that matter (GQA, tied and untied embeddings, llama3's rotary scaling, a sliding window, qwen3's head_dim)."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def tiny_config(family: str, vocab_size: int, **overrides):
    """A two-layer config of the family; overrides replace its fields (rope_parameters replaces llama3's
    scaling)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    shape = dict(
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
    shape |= overrides
    if family == "llama":
        if "rope_parameters" not in shape:
            scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
            shape["rope_scaling"] = {**scaling, "original_max_position_embeddings": 64}
        return LlamaConfig(**shape)
    if family == "mistral":
        return MistralConfig(**shape, sliding_window=512)
    if family == "qwen2":
        return Qwen2Config(**shape)
    return Qwen3Config(**shape, head_dim=32)


def save_tiny_model(path: Path, config, tokenizer=None) -> str:
    """The config's model with seeded random weights, saved as safetensors (with the tokenizer, if given)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return str(path)
