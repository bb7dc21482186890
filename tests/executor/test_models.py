"""Loading a checkpoint into the model's fused projections (q/k/v and gate/up stacked into one GEMM each)."""

from __future__ import annotations

import pytest
import torch

from executor.models.llama import DecoderSpec
from executor.models.loader import stack_projections

SPEC = DecoderSpec(
    vocab_size=32,
    hidden_size=8,
    intermediate_size=12,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling=None,
    max_position=64,
    tie_word_embeddings=True,
)


def layer_tensors(prefix: str = "model.layers.0") -> dict[str, torch.Tensor]:
    shapes = {
        "self_attn.q_proj.weight": (8, 8),
        "self_attn.k_proj.weight": (4, 8),
        "self_attn.v_proj.weight": (4, 8),
        "self_attn.o_proj.weight": (8, 8),
        "mlp.gate_proj.weight": (12, 8),
        "mlp.up_proj.weight": (12, 8),
        "mlp.down_proj.weight": (8, 12),
    }
    return {f"{prefix}.{name}": torch.randn(shape) for name, shape in shapes.items()}


def test_parts_are_stacked_in_order_whatever_order_they_come_in() -> None:
    tensors = layer_tensors()
    shuffled = sorted(tensors.items(), key=lambda item: item[0][::-1])  # v before q, up before gate
    out = dict(stack_projections(SPEC, shuffled))
    p = "model.layers.0"
    assert sorted(out) == sorted(
        [
            f"{p}.self_attn.qkv_proj.weight",
            f"{p}.self_attn.o_proj.weight",
            f"{p}.mlp.gate_up_proj.weight",
            f"{p}.mlp.down_proj.weight",
        ]
    )
    qkv = [tensors[f"{p}.self_attn.{n}_proj.weight"] for n in "qkv"]
    assert torch.equal(out[f"{p}.self_attn.qkv_proj.weight"], torch.cat(qkv))
    gate_up = [tensors[f"{p}.mlp.{n}_proj.weight"] for n in ("gate", "up")]
    assert torch.equal(out[f"{p}.mlp.gate_up_proj.weight"], torch.cat(gate_up))


def test_biases_are_stacked_like_weights() -> None:
    biases = {
        f"model.layers.0.self_attn.{n}_proj.bias": torch.randn(r)
        for n, r in zip("qkv", (8, 4, 4), strict=True)
    }
    out = dict(stack_projections(SPEC, biases.items()))
    assert torch.equal(out["model.layers.0.self_attn.qkv_proj.bias"], torch.cat(list(biases.values())))


def test_a_misshapen_part_is_named() -> None:
    tensors = layer_tensors()
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.randn(8, 8)
    with pytest.raises(ValueError, match=r"self_attn\.k_proj\.weight.*\(8, 8\).*4 rows"):
        list(stack_projections(SPEC, tensors.items()))


def test_a_missing_part_is_named() -> None:
    tensors = layer_tensors()
    del tensors["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"lacks model\.layers\.0\.mlp\.up_proj\.weight"):
        list(stack_projections(SPEC, tensors.items()))
