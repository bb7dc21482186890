"""The Llama family as one decoder: Llama (with Llama 3 rope scaling), Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

Weights keep HuggingFace's names, except that q/k/v and gate/up projections are stacked into one GEMM each
(qkv_proj, gate_up_proj; FUSED_PROJECTIONS says how a checkpoint's tensors map onto them). The model is built with
its kernels (kvkernels/backend.py): attention reads and writes the paged KV cache through their paged_attention /
reshape_and_cache, and the layers call their fused residual add + RMSNorm, rotary embedding, SiLU and multiply.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from executor.lora.lora_batch import StackAdapters
from kvkernels.backend import Kernels
from kvkernels.decoder_stack import StackLayer, build_decoder_stack

if TYPE_CHECKING:
    from executor.lora.lora_batch import LoRABatch


@dataclass(slots=True)
class AttentionBatch:
    """Where each token of the flattened batch sits in the paged cache."""

    slot_mapping: torch.Tensor  # [T] int64
    block_table: torch.Tensor  # [S, M] int32
    seq_lens: torch.Tensor  # [S] int32, context length after this step
    query_start_loc: torch.Tensor  # [S+1] int32
    lora: LoRABatch | None = None  # rows that run under LoRA adapters (executor/lora/lora_batch.py)


@dataclass(slots=True)
class DecoderSpec:
    """What distinguishes the family's members, read off a HF config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None  # attention is full; contexts are kept within the window instead


# fused parameter -> the checkpoint's parameters stacked into it, in order (suffixes of the module path)
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def part_rows(spec: DecoderSpec) -> dict[str, int]:
    """Output rows of each checkpoint projection that is stacked into a fused one."""
    q, kv, ffn = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.intermediate_size
    return {
        "self_attn.q_proj": q,
        "self_attn.k_proj": kv,
        "self_attn.v_proj": kv,
        "mlp.gate_proj": ffn,
        "mlp.up_proj": ffn,
    }


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_inv_freq(spec: DecoderSpec) -> torch.Tensor:
    """Rotary frequencies, with Llama 3's long-context rescaling when the config asks for it; on the host, even
    inside the meta-device context the model is built in (placed where it runs as it loads)."""
    steps = torch.arange(0, spec.head_dim, 2, dtype=torch.float64, device="cpu")
    inv_freq = 1.0 / (spec.rope_theta ** (steps / spec.head_dim))
    scaling = spec.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return inv_freq.float()
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r}")
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled).float()


class Attention(nn.Module):
    def __init__(self, spec: DecoderSpec, kernels: Kernels, layer: int = 0) -> None:
        super().__init__()
        self.kernels, self.layer = kernels, layer
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size, self.kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        # q, k and v in one GEMM (HF's q_proj, k_proj, v_proj stacked at load time): one pass over the input
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=False)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.scale = spec.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        batch: AttentionBatch,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if batch.lora is not None:
            batch.lora.add(self.layer, "self_attn.qkv_proj", x, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.kernels.rotary_embedding(q, k, cos, sin)
        key_cache, value_cache = kv_cache
        self.kernels.reshape_and_cache(k, v, key_cache, value_cache, batch.slot_mapping)
        o = self.kernels.paged_attention(
            q, key_cache, value_cache, batch.block_table, batch.seq_lens, batch.query_start_loc, self.scale
        )
        o = o.reshape(t, -1)
        out = self.o_proj(o)
        if batch.lora is not None:
            batch.lora.add(self.layer, "self_attn.o_proj", o, out)
        return out


class MLP(nn.Module):
    def __init__(self, spec: DecoderSpec, kernels: Kernels, layer: int = 0) -> None:
        super().__init__()
        self.kernels, self.layer = kernels, layer
        # gate and up in one GEMM (HF's gate_proj and up_proj stacked at load time)
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        if lora is None:
            return self.down_proj(self.kernels.silu_and_mul(self.gate_up_proj(x)))
        gate_up = self.gate_up_proj(x)
        lora.add(self.layer, "mlp.gate_up_proj", x, gate_up)
        h = self.kernels.silu_and_mul(gate_up)
        out = self.down_proj(h)
        lora.add(self.layer, "mlp.down_proj", h, out)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, kernels: Kernels, layer: int = 0) -> None:
        super().__init__()
        self.kernels = kernels
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, kernels, layer)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec, kernels, layer)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos, sin, kv_cache, batch: AttentionBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: what the layer before added to the residual stream (the first layer: the embeddings, with no
        residual yet). Returns this layer's addition and the stream before it, so that each add is fused with
        the norm that follows it: residual + attn(norm(residual)), then + mlp(norm(...)), as HF computes."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.kernels.add_rms_norm(
                x, residual, self.input_layernorm.weight, self.input_layernorm.eps
            )
        h = self.self_attn(h, cos, sin, kv_cache, batch)
        norm = self.post_attention_layernorm
        h, residual = self.kernels.add_rms_norm(h, residual, norm.weight, norm.eps)
        return self.mlp(h, batch.lora), residual


class Backbone(nn.Module):
    def __init__(self, spec: DecoderSpec, kernels: Kernels) -> None:
        super().__init__()
        # built on the meta device and loaded; an initial value would be thrown away, and drawing one imports
        # torch's compiler (about a second of every executor's start)
        self.embed_tokens = nn.Embedding(
            spec.vocab_size, spec.hidden_size, _weight=torch.empty(spec.vocab_size, spec.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(spec, kernels, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class DecoderLM(nn.Module):
    """Token ids and positions of a flattened batch in, final hidden states out; logits only where asked."""

    def __init__(self, spec: DecoderSpec, kernels: Kernels) -> None:
        super().__init__()
        self.spec, self.kernels = spec, kernels
        self.model = Backbone(spec, kernels)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # a plain attribute, not a buffer: it must stay float32 when the weights are cast to bf16
        self.inv_freq = rope_inv_freq(spec)
        self.decoder_stack = None  # fuse_decode_layers() sets it where it can serve

    def fuse_decode_layers(self) -> bool:
        """Run steps of decodes through the C++ decoder stack (kvkernels/decoder_stack.py) where the kernels and
        the packed weights allow: the same kernels and results, less host work. Call after Kernels.prepare."""
        self.decoder_stack = None
        if self.kernels.name != "torch" or self.spec.qk_norm:
            return False
        if any(
            layer.input_layernorm.eps != layer.post_attention_layernorm.eps for layer in self.model.layers
        ):
            return False
        layers = [
            StackLayer(
                layer.input_layernorm.weight,
                layer.post_attention_layernorm.weight,
                layer.input_layernorm.eps,
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            )
            for layer in self.model.layers
        ]
        attention = self.model.layers[0].self_attn
        self.decoder_stack = build_decoder_stack(
            layers, attention.num_heads, attention.num_kv_heads, attention.head_dim, attention.scale
        )
        self.stack_adapters = None if self.decoder_stack is None else StackAdapters(self.decoder_stack)
        return self.decoder_stack is not None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        batch: AttentionBatch,
    ) -> torch.Tensor:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        x = self.model.embed_tokens(input_ids)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        # a step of decodes, one token per sequence, runs in the stack; under adapters where each one's rows are
        # one slice of the batch
        decodes = self.decoder_stack is not None and input_ids.shape[0] == batch.block_table.shape[0]
        lora = [] if not decodes or batch.lora is None else self.stack_adapters.groups(batch.lora)
        if decodes and lora is not None:
            keys, values = zip(*kv_caches, strict=True)
            x, residual = self.decoder_stack.forward(
                x, cos, sin, keys, values, batch.block_table, batch.seq_lens, batch.slot_mapping, lora
            )
        else:
            residual = None
            for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
                x, residual = layer(x, residual, cos, sin, kv_cache, batch)
        norm = self.model.norm
        return self.kernels.add_rms_norm(x, residual, norm.weight, norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
