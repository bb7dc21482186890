"""A stand-in for the default model on the GPU machine, which cannot fetch it and to which its 94 MB GGUF
cannot travel (a call carries 64 MiB in all): the model's own config and tokenizer, with random weights.

Throughput does not depend on the weights (check.py's requests ignore EOS and run to a fixed length), so
the end-to-end figures hold for the real model. The weights are drawn 5x wider than HF's initialisation: at
HF's 0.02 every prompt continues with one token repeated, which would make token agreement between backends
say nothing. Here, pack the small files; there, build the weights:

    python -m bench.gpu.model pack .gpu/model            # here: config, tokenizer, templates (~4 MB)
    python -m bench.gpu.model build .gpu/model DEST      # there: DEST holds them plus random safetensors

`build --num-layers 2` keeps everything of the packed config but its depth: the default model's layout at a
fraction of its cost, for session.sh's dry run in Triton's interpreter and for CPU tests.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

# everything of a model directory but its weights
SMALL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)

INIT_STD = 0.1


def pack(dest: Path) -> list[str]:
    """Copy the default model's small files into dest; returns their names."""
    from executor import resolve_model

    source = resolve_model(None)
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in SMALL_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, dest / name)
            copied.append(name)
    return copied


def build(packed: Path, dest: Path, seed: int = 0, num_layers: int | None = None) -> Path:
    """dest: packed's files and random weights of packed's config (num_layers deep, if given), as safetensors;
    kept if already built at that depth."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (packed / "config.json").is_file():
        raise FileNotFoundError(
            f"{packed}: no config.json (run `python -m bench.gpu.model pack {packed}` first)"
        )
    config = AutoConfig.from_pretrained(packed, local_files_only=True)
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"num_layers: must be at least 1, got {num_layers}")
        config.num_hidden_layers = num_layers
        # configs that name each layer's kind (sliding or full attention) keep a list as long as the model
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = config.layer_types[:num_layers]
    if _built_layers(dest) == config.num_hidden_layers:
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config.initializer_range = INIT_STD
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(dest)
    # save_pretrained rewrote config.json; the packed tokenizer files are the model's
    for name in SMALL_FILES:
        if (packed / name).is_file() and name != "config.json":
            shutil.copy2(packed / name, dest / name)
    return dest


def _built_layers(dest: Path) -> int | None:
    """How many layers the model already built in dest has, or None where none is."""
    if not (dest / "model.safetensors").is_file() or not (dest / "config.json").is_file():
        return None
    return json.loads((dest / "config.json").read_text()).get("num_hidden_layers")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("pack", help="copy the default model's config and tokenizer").add_argument(
        "dest", type=Path
    )
    built = sub.add_parser("build", help="random weights for a packed config")
    built.add_argument("packed", type=Path)
    built.add_argument("dest", type=Path)
    built.add_argument(
        "--num-layers", type=int, default=None, help="layers to build (default: the packed config's)"
    )
    args = parser.parse_args(argv)
    if args.command == "pack":
        print(f"{args.dest}: {', '.join(pack(args.dest))}")
    else:
        try:
            print(build(args.packed, args.dest, num_layers=args.num_layers))
        except (FileNotFoundError, ValueError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
