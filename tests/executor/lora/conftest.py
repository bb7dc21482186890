"""PEFT adapters of the tiny llama, built once per module: random A and B, saved, and their merged models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# name -> PEFT LoraConfig fields: q/v alone (PEFT's default for llama), every module, rsLoRA on the MLP
ADAPTERS = {
    "qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all": dict(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "mlp": dict(r=2, lora_alpha=4, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"]),
}


def make_adapter(base: str, out: Path, seed: int, **fields) -> tuple[str, str]:
    """A PEFT adapter with random A and B (B is zero at PEFT's usual init), saved; and the merged model, saved."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, lora_dropout=0.0, **fields))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.2)
    peft_model.save_pretrained(out / "adapter")
    peft_model.merge_and_unload().save_pretrained(out / "merged")
    return str(out / "adapter"), str(out / "merged")


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory) -> dict[str, tuple[str, str]]:
    root = tmp_path_factory.mktemp("lora")
    return {
        name: make_adapter(tiny_models["llama"], root / name, seed, **fields)
        for seed, (name, fields) in enumerate(ADAPTERS.items())
    }
