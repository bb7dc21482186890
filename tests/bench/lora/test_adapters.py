"""The benchmark's random adapters are adapters kvserve serves: its own loader takes them on the default model."""

import argparse
import json

import pytest
import torch
from safetensors import safe_open

from bench.lora.adapters import DEFAULT_MODULES, DEFAULT_RANK, make_adapters, module_shapes, parse_modules
from executor.lora.adapter_files import AdapterError, load_adapter
from executor.lora.adapters import max_adapter_bytes
from executor.models.loader import decoder_spec
from executor.models.model_files import read_config


@pytest.fixture(scope="module")
def spec(default_model):
    return decoder_spec(read_config(default_model))


def test_default_adapters_load_on_the_default_model_each_its_own(default_model, spec, tmp_path):
    paths = make_adapters(tmp_path, 2, default_model)
    assert list(paths) == ["a0", "a1"]
    bound = max_adapter_bytes(spec, DEFAULT_RANK)
    loaded = [load_adapter(n, p, spec, DEFAULT_RANK, bound, torch.float32) for n, p in paths.items()]
    for adapter in loaded:
        assert adapter.rank == DEFAULT_RANK and adapter.modules == tuple(sorted(DEFAULT_MODULES))
        assert len(adapter.layers) == spec.num_layers
        assert all(set(layer) == {"self_attn.qkv_proj", "self_attn.o_proj"} for layer in adapter.layers)
    assert loaded[0].digest != loaded[1].digest  # seeded apart: two adapters, not one twice
    config = json.loads((paths["a0"] / "adapter_config.json").read_text())
    assert (
        config["peft_type"] == "LORA"
        and config["r"] == DEFAULT_RANK
        and config["lora_alpha"] == 2 * DEFAULT_RANK
    )


def test_rank_and_modules_are_options_and_the_tensors_are_pefts(default_model, spec, tmp_path):
    modules = parse_modules("q,v,mlp")
    assert modules == ("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj")
    path = make_adapters(tmp_path, 1, default_model, rank=8, modules=modules)["a0"]
    adapter = load_adapter("a0", path, spec, 8, max_adapter_bytes(spec, 8), torch.float32)
    assert adapter.rank == 8 and set(adapter.layers[0]) == {
        "self_attn.qkv_proj",
        "mlp.gate_up_proj",
        "mlp.down_proj",
    }
    config = json.loads(read_config(default_model).to_json_string())
    shapes = module_shapes(config)
    with safe_open(str(path / "adapter_model.safetensors"), framework="pt") as tensors:
        names = set(tensors.keys())
        a = tensors.get_tensor("base_model.model.model.layers.0.mlp.down_proj.lora_A.weight")
        b = tensors.get_tensor("base_model.model.model.layers.0.mlp.down_proj.lora_B.weight")
    assert len(names) == 2 * len(modules) * spec.num_layers
    assert tuple(a.shape) == (8, shapes["down_proj"][0]) and tuple(b.shape) == (shapes["down_proj"][1], 8)
    assert b.abs().sum() > 0  # B drawn too: the adapter changes the model's output
    with pytest.raises(AdapterError, match="over --max-lora-rank"):
        load_adapter("a0", path, spec, 4, max_adapter_bytes(spec, 4), torch.float32)


def test_module_names_are_checked():
    assert parse_modules("all") == parse_modules("attention,mlp")
    assert parse_modules("q_proj,q") == ("q_proj",)
    for bad in ("lm_head", "q,embed", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="target modules"):
            parse_modules(bad)
