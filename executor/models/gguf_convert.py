"""A GGUF file becomes a HuggingFace model directory, so the engine has one loading path for every model.

The directory holds config.json, float32 model.safetensors under HF tensor names, the tokenizer with the
file's chat template, and generation_config.json; and the file's quantized weights as they are, which
--quantization auto serves instead of their float32 copies (executor/models/gguf_quantized.py).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file
from transformers import (
    GenerationConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from executor.models.gguf_quantized import converts, quantized_weight, save_blocks, take_rows
from kvkernels.quantized import QuantizedWeight
from shared.model_paths import GGUF_BLOCKS, ModelLoadError

# GGUF architecture -> the HF config class that describes it.
CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
}

# llama.cpp's tensor names (see gguf.constants.TENSOR_NAMES) -> transformers' names.
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Write the model directory beside out_dir first and rename it into place, so out_dir is whole or absent."""
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; remove it to convert again")
    reader = GGUFReader(gguf_path)
    config = _hf_config(reader, gguf_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=out_dir.parent))
    try:
        save_file(
            _hf_tensors(reader, config, gguf_path), staging / "model.safetensors", metadata={"format": "pt"}
        )
        (staging / GGUF_BLOCKS).parent.mkdir()
        save_blocks(_hf_blocks(reader, config, gguf_path), staging / GGUF_BLOCKS)
        config.save_pretrained(staging)
        _save_tokenizer(gguf_path, config, staging)
        GenerationConfig(
            bos_token_id=config.bos_token_id,
            eos_token_id=config.eos_token_id,
            pad_token_id=config.pad_token_id,
        ).save_pretrained(staging)
        # mkdtemp and safetensors create owner-only; a model cache is read like any downloaded model.
        os.chmod(staging, 0o755)
        for made in (staging / GGUF_BLOCKS).parent, staging / "model.safetensors", staging / GGUF_BLOCKS:
            os.chmod(made, 0o755 if made.is_dir() else 0o644)
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _hf_config(reader: GGUFReader, gguf_path: Path) -> PretrainedConfig:
    """The HF config the file's metadata describes; anything we cannot map exactly is refused, not guessed."""
    arch = _metadata(reader, "general.architecture")
    if arch not in CONFIG_CLASSES:
        raise ModelLoadError(
            f"{gguf_path}: unsupported GGUF architecture {arch!r}; kvserve converts {sorted(CONFIG_CLASSES)}"
        )
    scaling = _metadata(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ModelLoadError(f"{gguf_path}: unsupported rope scaling {scaling!r}")
    hidden_size = _metadata(reader, f"{arch}.embedding_length")
    num_heads = _metadata(reader, f"{arch}.attention.head_count")
    head_dim = _metadata(reader, f"{arch}.attention.key_length", hidden_size // num_heads)
    rotary_dim = _metadata(reader, f"{arch}.rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise ModelLoadError(f"{gguf_path}: partial rotary ({rotary_dim} of {head_dim} dims) is unsupported")
    vocab_size = _metadata(reader, f"{arch}.vocab_size", None) or len(
        _metadata(reader, "tokenizer.ggml.tokens")
    )
    tensor_names = {tensor.name for tensor in reader.tensors}
    config = CONFIG_CLASSES[arch](
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=_metadata(reader, f"{arch}.feed_forward_length"),
        num_hidden_layers=_metadata(reader, f"{arch}.block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=_metadata(reader, f"{arch}.attention.head_count_kv", num_heads),
        head_dim=head_dim,
        max_position_embeddings=_metadata(reader, f"{arch}.context_length"),
        rms_norm_eps=_metadata(reader, f"{arch}.attention.layer_norm_rms_epsilon"),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": _metadata(reader, f"{arch}.rope.freq_base", 10000.0),
        },
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_metadata(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_id=_metadata(reader, "tokenizer.ggml.eos_token_id", None),
        pad_token_id=_metadata(reader, "tokenizer.ggml.padding_token_id", None),
        dtype="float32",
    )
    if arch == "llama":
        config.attention_bias = "blk.0.attn_q.bias" in tensor_names
    config.architectures = [f"{type(config).__name__.removesuffix('Config')}ForCausalLM"]
    return config


def add_gguf_blocks(gguf_path: Path, model_dir: Path) -> None:
    """The quantized weights for a directory converted before they were kept beside the float32 ones; written
    beside GGUF_BLOCKS and renamed into place, so the file is whole or absent."""
    reader = GGUFReader(gguf_path)
    blocks = _hf_blocks(reader, _hf_config(reader, gguf_path), gguf_path)
    target = model_dir / GGUF_BLOCKS
    target.parent.mkdir(mode=0o755, exist_ok=True)
    partial = target.with_suffix(".partial")
    try:
        save_blocks(blocks, partial)
        os.chmod(partial, 0o644)
        os.replace(partial, target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def _hf_tensors(reader: GGUFReader, config: PretrainedConfig, gguf_path: Path) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32 under its HF name, with llama's rotary permutation undone."""
    tensors = {}
    for tensor in reader.tensors:
        weight = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        if (heads := _rotary_heads(tensor.name, config)) is not None:
            weight = unpermute_rotary(weight, heads)
        tensors[_hf_name(tensor.name, gguf_path)] = np.ascontiguousarray(weight)
    return tensors


def _hf_blocks(
    reader: GGUFReader, config: PretrainedConfig, gguf_path: Path
) -> dict[str, tuple[QuantizedWeight, str]]:
    """Each weight held in a block type kvserve serves, as its blocks (with the rows in _hf_tensors' order)
    and its type's name."""
    blocks = {}
    for tensor in reader.tensors:
        if not converts(tensor.tensor_type) or tensor.data.ndim != 2:
            continue
        weight = quantized_weight(tensor.data, tensor.tensor_type)
        if (heads := _rotary_heads(tensor.name, config)) is not None:
            rows = unpermute_rotary(np.arange(weight.shape[0]), heads)
            weight = take_rows(weight, torch.from_numpy(rows))
        blocks[_hf_name(tensor.name, gguf_path)] = (weight, tensor.tensor_type.name)
    return blocks


def _rotary_heads(gguf_name: str, config: PretrainedConfig) -> int | None:
    """The heads whose rows llama.cpp permuted in this tensor, or None."""
    if config.model_type == "llama" and ".attn_q." in gguf_name:
        return config.num_attention_heads
    if config.model_type == "llama" and ".attn_k." in gguf_name:
        return config.num_key_value_heads
    return None


def _hf_name(gguf_name: str, gguf_path: Path) -> str:
    """An unknown tensor (llama 3's rope_freqs, say) means a model we would run wrongly, so it is an error."""
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    match = LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in LAYER_TENSORS:
        raise ModelLoadError(f"{gguf_path}: unsupported tensor {gguf_name!r}")
    return f"model.layers.{match[1]}.{LAYER_TENSORS[match[2]]}.{match[3]}"


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp interleaves each head's rotary pairs; HF's rotate_half wants the two halves apart.

    Inverse of llama.cpp's convert_hf_to_gguf `permute`, as transformers' GGUF loader undoes it.
    """
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _save_tokenizer(gguf_path: Path, config: PretrainedConfig, out_dir: Path) -> None:
    """transformers rebuilds the tokenizer from the GGUF vocabulary; saving it writes the chat template too."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True
    )
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)


_REQUIRED = object()


def _metadata(reader: GGUFReader, key: str, default: Any = _REQUIRED) -> Any:
    """One metadata value; a missing required key names itself rather than raising a bare KeyError."""
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise ModelLoadError(f"GGUF metadata lacks {key!r}")
        return default
    return field.contents()
