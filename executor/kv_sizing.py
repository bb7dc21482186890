"""How many bytes become KV blocks: --kv-cache-memory outright, or on CUDA a share of the device after a
profiling step has shown what weights and activations need."""

from __future__ import annotations

import logging

import torch

from executor.models import AttentionBatch, DecoderLM
from kernels.backend import AttentionBackend
from shared.engine_config import EngineConfig

log = logging.getLogger("kvserve.engine")

CPU_DEFAULT_KV_BYTES = 4 * 2**30  # vLLM's CPU default (VLLM_CPU_KVCACHE_SPACE=4)


def pick_device_and_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda was asked for, but torch sees no CUDA device")
    dev = torch.device(
        "cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu"
    )
    if dtype == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    return dev, getattr(torch, dtype)


def kv_cache_bytes(
    config: EngineConfig,
    model: DecoderLM,
    device: torch.device,
    dtype: torch.dtype,
    attention: AttentionBackend,
) -> int:
    if config.kv_cache_memory is not None:
        return int(config.kv_cache_memory)
    if device.type != "cuda":
        return CPU_DEFAULT_KV_BYTES
    return _profile_cuda(config, model, device, dtype, attention)


@torch.inference_mode()
def _profile_cuda(
    config: EngineConfig,
    model: DecoderLM,
    device: torch.device,
    dtype: torch.dtype,
    attention: AttentionBackend,
) -> int:
    """gpu_memory_utilization x device memory, minus what others hold, weights and the peak of a full step,
    run with the kernels that will serve (their scratch memory differs)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    held_by_others = (total - free) - torch.cuda.memory_reserved(device)
    spec = model.spec
    n = config.max_num_batched_tokens
    bs = config.block_size
    num_blocks = -(-n // bs)
    scratch = torch.zeros(
        (spec.num_layers, 2, num_blocks, bs, spec.num_kv_heads, spec.head_dim), dtype=dtype, device=device
    )
    caches = [(scratch[i, 0], scratch[i, 1]) for i in range(spec.num_layers)]
    positions = torch.arange(n, device=device)
    batch = AttentionBatch(
        slot_mapping=positions,
        block_table=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        attention=attention,
    )
    input_ids = torch.zeros(n, dtype=torch.int64, device=device)
    hidden = model(input_ids, positions, caches, batch)
    model.compute_logits(hidden[-min(n, config.max_num_seqs) :]).softmax(-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - scratch.numel() * scratch.element_size()
    del scratch, caches, hidden
    torch.cuda.empty_cache()
    budget = int(total * config.gpu_memory_utilization) - held_by_others - peak
    log.info(
        "profiling: %.2f GiB device, %.2f GiB held by others, %.2f GiB weights+activation peak -> %.2f GiB for KV",
        total / 2**30,
        held_by_others / 2**30,
        peak / 2**30,
        budget / 2**30,
    )
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization {config.gpu_memory_utilization} leaves no memory for the KV cache; raise it "
            "or lower max_num_batched_tokens"
        )
    return budget
