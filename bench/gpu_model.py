"""A stand-in for the default model on the GPU machine, which cannot fetch it and to which its 94 MB GGUF
cannot travel (a call carries 64 MiB in all): the model's own config and tokenizer, with random weights.

Throughput does not depend on the weights (gpu_check's requests ignore EOS and run to a fixed length), so
the end-to-end figures hold for the real model. The weights are drawn 5x wider than HF's initialisation: at
HF's 0.02 every prompt continues with one token repeated, which would make token agreement between backends
say nothing. Here, pack the small files; there, build the weights:

    python -m bench.gpu_model pack .gpu/model            # here: config, tokenizer, templates (~4 MB)
    python -m bench.gpu_model build .gpu/model DEST      # there: DEST holds them plus random safetensors
"""

from __future__ import annotations

import argparse
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


def build(packed: Path, dest: Path, seed: int = 0) -> Path:
    """dest: packed's files and random weights of packed's config, as safetensors; kept if already built."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if (dest / "model.safetensors").is_file():
        return dest
    if not (packed / "config.json").is_file():
        raise FileNotFoundError(
            f"{packed}: no config.json (run `python -m bench.gpu_model pack {packed}` first)"
        )
    dest.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(packed, local_files_only=True)
    config.initializer_range = INIT_STD
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(dest)
    for (
        name
    ) in SMALL_FILES:  # save_pretrained rewrote config.json; the packed tokenizer files are the model's
        if (packed / name).is_file() and name != "config.json":
            shutil.copy2(packed / name, dest / name)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("pack", help="copy the default model's config and tokenizer").add_argument(
        "dest", type=Path
    )
    built = sub.add_parser("build", help="random weights for a packed config")
    built.add_argument("packed", type=Path)
    built.add_argument("dest", type=Path)
    args = parser.parse_args(argv)
    if args.command == "pack":
        print(f"{args.dest}: {', '.join(pack(args.dest))}")
    else:
        try:
            print(build(args.packed, args.dest))
        except FileNotFoundError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
