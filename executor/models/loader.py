"""Which of our model classes serves a HF architecture, and how a checkpoint becomes one."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from executor.models.llama import FUSED_PROJECTIONS, DecoderLM, DecoderSpec, part_rows
from executor.models.quantized import place_quantized, stack
from kvkernels.backend import Kernels
from kvkernels.quantized import ACTIVATION_PLANES, QuantizedLinear, QuantizedWeight
from kvkernels.weight_quantization import quantize_linears

# architecture -> (qkv bias, q/k norm)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}


class UnsupportedModelError(ValueError):
    pass


def decoder_spec(config) -> DecoderSpec:
    archs = getattr(config, "architectures", None) or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"unsupported architecture {archs or config.model_type!r}; kvserve serves {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
    if getattr(config, "attention_bias", False):
        qkv_bias = True
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    rope_scaling = getattr(config, "rope_scaling", None)
    rope_theta = getattr(config, "rope_theta", None)
    rope_parameters = getattr(config, "rope_parameters", None)  # transformers >= 5 folds both in here
    if rope_parameters:
        rope_theta = rope_parameters.get("rope_theta", rope_theta)
        if rope_parameters.get("rope_type", "default") != "default":
            rope_scaling = rope_parameters
    window = getattr(config, "sliding_window", None)
    if arch.startswith("Qwen") and not getattr(config, "use_sliding_window", False):
        window = None  # Qwen configs carry a window size they do not use
    return DecoderSpec(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=rope_theta or 10000.0,
        rope_scaling=rope_scaling,
        max_position=config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        sliding_window=window,
    )


_PART_OF = {part: (fused, i) for fused, parts in FUSED_PROJECTIONS.items() for i, part in enumerate(parts)}
_PART_NAME = re.compile(
    r"(?P<layer>.+)\.(?P<part>" + "|".join(map(re.escape, _PART_OF)) + r")\.(?P<kind>weight|bias)"
)


Weight = torch.Tensor | QuantizedWeight  # a checkpoint's linear weights may come quantized (a GGUF's blocks)


def stack_projections(
    spec: DecoderSpec, weights: Iterable[tuple[str, Weight]]
) -> Iterator[tuple[str, Weight]]:
    """The checkpoint's tensors under the model's names: q/k/v and gate/up stacked, in FUSED_PROJECTIONS'
    order, into their fused projection once every part has come. A misshapen or missing part is an error
    naming it."""
    rows = part_rows(spec)
    pending: dict[tuple[str, str, str], dict[int, Weight]] = {}  # (layer, fused, kind) -> parts so far
    for name, tensor in weights:
        match = _PART_NAME.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        part = match["part"]
        if tensor.shape[0] != rows[part]:
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the config implies "
                f"{rows[part]} rows"
            )
        fused, index = _PART_OF[part]
        key = (match["layer"], fused, match["kind"])
        parts = pending.setdefault(key, {})
        parts[index] = tensor
        if len(parts) == len(FUSED_PROJECTIONS[fused]):
            del pending[key]
            yield ".".join(key), stack([parts[i] for i in range(len(parts))])
    for (layer, fused, kind), parts in pending.items():
        missing = next(p for i, p in enumerate(FUSED_PROJECTIONS[fused]) if i not in parts)
        raise ValueError(f"checkpoint lacks {layer}.{missing}.{kind}, which {layer}.{fused}.{kind} stacks")


def build_model(
    spec: DecoderSpec,
    weights: Iterable[tuple[str, Weight]],
    dtype: torch.dtype,
    device: torch.device,
    kernels: Kernels,
    quantization: str = "auto",
    quantization_group_size: int | None = None,
    quantized_activations: str = "int8",
) -> DecoderLM:
    """Instantiate on the meta device, then take every parameter from the checkpoint (a missing or misshapen
    tensor is an error naming it; a QuantizedWeight replaces its module, models/quantized.py), quantize its
    float linear layers as --quantization asks, and let the kernels prepare the weights they run on (quantized
    ones multiplying the activations as --quantized-activations says)."""
    with torch.device("meta"):
        model = DecoderLM(spec, kernels)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedWeight] = {}
    for name, tensor in stack_projections(spec, weights):
        if name not in params:
            if name == "lm_head.weight" and spec.tie_word_embeddings:
                continue
            if "rotary_emb" in name:
                continue
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the config implies {tuple(params[name].shape)}"
            )
        if isinstance(tensor, QuantizedWeight):
            quantized[name] = tensor
        else:
            loaded[name] = tensor.to(device=device, dtype=dtype)
    if spec.tie_word_embeddings:
        loaded.pop("lm_head.weight", None)
        quantized.pop("lm_head.weight", None)
        params.pop("lm_head.weight")
    missing = sorted(set(params) - set(loaded) - set(quantized))
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    model.load_state_dict(loaded, strict=False, assign=True)
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    place_quantized(model, quantized, spec.tie_word_embeddings, device, dtype)
    model.inv_freq = model.inv_freq.to(device)
    model.eval().requires_grad_(False)
    quantize_linears(model, quantization, quantization_group_size)
    for layer in model.modules():
        if isinstance(layer, QuantizedLinear):
            layer.activation_planes = ACTIVATION_PLANES[quantized_activations]
    kernels.prepare(model, device, dtype)
    model.fuse_decode_layers()
    return model
