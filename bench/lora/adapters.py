"""Random LoRA adapters for a base model, written as PEFT directories, for benchmarks that need many of them.

Each adapter is what PEFT's `save_pretrained` writes: adapter_config.json and adapter_model.safetensors with PEFT's
key names (`base_model.model.model.layers.{l}.self_attn.q_proj.lora_A.weight`, rank x inputs; `lora_B`, outputs x
rank). Shapes come from the model's config.json, never hard-coded. A and B are both drawn at random (PEFT starts B
at zero, which would leave the base model's tokens unchanged and hide nothing a real fine-tune costs).

Defaults: rank 16 on q_proj, k_proj, v_proj and o_proj. Attention's four projections are what most LoRA recipes
adapt, and 16 is the largest rank vLLM serves without --max-lora-rank: the heaviest adapter both engines take by
default, so a throughput ratio measured with it is the conservative one.

    python -m bench.lora.adapters --count 8 --out /tmp/adapters     # prints name=path, one a line
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.kv_tiers.workload import model_config
from shared.model_paths import pulled_model_dir

DEFAULT_RANK = 16
DEFAULT_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# with lora_alpha = 2r (scale 2): the text stays fluent, and a prompt's first greedy tokens change (at 0.02, a
# rank-16 q/k/v/o adapter left "The capital of France is" answered as the base model answers it)
INIT_STD = 0.05


def module_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(inputs, outputs) of each module an adapter may target, from the model's config.json."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = (config.get("num_key_value_heads") or heads) * head_dim
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def adapter_tensors(config: dict, rank: int, modules: Sequence[str], seed: int) -> dict[str, torch.Tensor]:
    """Every layer's A and B for each module, under PEFT's key names, drawn from a generator seeded by `seed`."""
    shapes = module_shapes(config)
    if unknown := sorted(set(modules) - set(shapes)):
        raise ValueError(f"unknown target modules {', '.join(unknown)}; known: {', '.join(shapes)}")
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in modules:
            block = "self_attn" if module in ATTENTION else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            inputs, outputs = shapes[module]
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, inputs, generator=generator) * INIT_STD
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(outputs, rank, generator=generator) * INIT_STD
    return tensors


def adapter_config(rank: int, modules: Sequence[str], base_model: str) -> dict:
    """adapter_config.json as PEFT writes it for a plain LoRA (what both kvserve and vLLM read)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def make_adapters(
    out: Path,
    count: int,
    model: str | None = None,
    rank: int = DEFAULT_RANK,
    modules: Sequence[str] = DEFAULT_MODULES,
    seed: int = 0,
) -> dict[str, Path]:
    """`count` adapters a0, a1, ... under out (each seeded apart), written again each call: name -> directory."""
    if count < 1 or rank < 1:
        raise ValueError(f"need at least one adapter of rank >= 1, got count={count} rank={rank}")
    config = model_config(model)
    base = str(pulled_model_dir(model))
    paths = {}
    for i in range(count):
        path = out / f"a{i}"
        path.mkdir(parents=True, exist_ok=True)
        save_file(
            adapter_tensors(config, rank, modules, seed * 1_000_003 + i),
            str(path / "adapter_model.safetensors"),
        )
        (path / "adapter_config.json").write_text(json.dumps(adapter_config(rank, modules, base), indent=1))
        paths[f"a{i}"] = path
    return paths


def parse_modules(text: str) -> tuple[str, ...]:
    """`q,k,v,o` or `q_proj,v_proj`; `attention`, `mlp` and `all` name the groups."""
    groups = {"attention": ATTENTION, "mlp": MLP, "all": ATTENTION + MLP}
    names: list[str] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if part in groups:
            names += groups[part]
        else:
            names.append(part if part.endswith("_proj") else f"{part}_proj")
    if unknown := sorted(set(names) - set(ATTENTION + MLP)):
        raise argparse.ArgumentTypeError(f"unknown target modules {', '.join(unknown)}")
    if not names:
        raise argparse.ArgumentTypeError("no target modules")
    return tuple(dict.fromkeys(names))


def add_adapter_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rank", type=int, default=DEFAULT_RANK, help="every adapter's rank (r)")
    parser.add_argument(
        "--target-modules",
        type=parse_modules,
        default=DEFAULT_MODULES,
        help="comma-separated: q,k,v,o,gate,up,down (or q_proj, ...), attention, mlp, all",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.lora.adapters", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--seed", type=int, default=0)
    add_adapter_args(parser)
    args = parser.parse_args(argv)
    for name, path in make_adapters(
        args.out, args.count, args.model, args.rank, args.target_modules, args.seed
    ).items():
        print(f"{name}={path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
