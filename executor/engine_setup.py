"""The parts an Engine is built from, one function each: the models, the KV pool's size, the scheduler over
that pool, the model runner, the proposers of speculative decoding."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig

from executor.engine_config import KV_OFFLOAD_DISK_BYTES, EngineConfig
from executor.kv.block_pool import BlockPool
from executor.kv.cache_manager import KVCacheManager
from executor.kv.layout import kv_block_bytes
from executor.kv.sizing import kv_cache_bytes, weight_bytes
from executor.kv.tiers.admission import ReuseAdmission
from executor.kv.tiers.disk_tier import DiskTier
from executor.kv.tiers.fingerprint import KVFingerprint, model_identity
from executor.kv.tiers.host_tier import HostTier
from executor.kv.tiers.offloader import KVTiers
from executor.lora.adapters import Adapters, parse_lora_modules
from executor.model_runner import ModelRunner
from executor.models.llama import DecoderLM
from executor.models.loader import build_model, decoder_spec
from executor.models.model_files import load_weights, read_config, resolve_model
from executor.scheduling.scheduler import Scheduler
from executor.spec_decode import NgramProposer
from executor.spec_decode.draft import DraftProposer, load_draft_model
from kvkernels.backend import Kernels

log = logging.getLogger("kvserve.engine")

NGRAM = "ngram"  # --speculative-model ngram: prompt lookup instead of a draft model


@dataclass(slots=True)
class Models:
    """The target model and what comes with it: tokenizer, stop tokens, context length, the draft if any."""

    path: Path
    tokenizer: object  # the HF tokenizer
    eos_token_ids: frozenset[int]
    vocab_size: int
    max_model_len: int
    target: DecoderLM
    draft: DecoderLM | None


def load_models(config: EngineConfig, device: torch.device, dtype: torch.dtype, kernels: Kernels) -> Models:
    """The target (and draft) built with the kernels that will serve them."""
    path = resolve_model(config.model)
    hf_config = read_config(path)
    spec = decoder_spec(hf_config)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    eos_token_ids = _eos_token_ids(hf_config, path, tokenizer)
    max_model_len = _max_model_len(config.max_model_len, spec)
    torch.manual_seed(config.seed)
    target = build_model(
        spec,
        load_weights(path, gguf_blocks=config.quantization == "auto"),
        dtype,
        device,
        kernels,
        config.quantization,
        config.quantization_group_size,
        config.quantized_activations,
    )
    log.info(
        "weights: %.1f MiB as served (--quantization %s)", weight_bytes(target) / 2**20, config.quantization
    )
    draft = None
    if config.speculative_model not in (None, NGRAM):
        draft = load_draft_model(
            config.speculative_model, tokenizer, spec.vocab_size, max_model_len, dtype, device, kernels
        )
    return Models(path, tokenizer, eos_token_ids, spec.vocab_size, max_model_len, target, draft)


def num_kv_blocks(
    config: EngineConfig, models: Models, device: torch.device, dtype: torch.dtype
) -> tuple[int, int]:
    """How many KV blocks the memory holds, and the bytes of one; a draft's blocks mirror the target's, so
    each block costs both."""
    block_bytes = sum(
        kv_block_bytes(m.spec, config.block_size, dtype) for m in (models.target, models.draft) if m
    )
    num_blocks = kv_cache_bytes(config, models.target, device, dtype) // block_bytes
    if num_blocks < 1:
        raise ValueError("kv_cache_memory: too small for even one KV block")
    return num_blocks, block_bytes


def build_scheduler(config: EngineConfig, num_blocks: int, max_model_len: int) -> Scheduler:
    """The scheduler over a KV cache manager over a pool of num_blocks blocks; config is resolved (its token
    budget decided: EngineConfig.resolved)."""
    pool = BlockPool(num_blocks, config.enable_prefix_caching, shares=config.kv_shares)
    kv = KVCacheManager(
        pool, config.block_size, -(-max_model_len // config.block_size) + 1, config.max_num_seqs
    )
    return Scheduler(
        kv,
        config.max_num_seqs,
        config.max_num_batched_tokens,
        max_model_len,
        config.enable_chunked_prefill,
        config.max_waiting_seqs,
        config.max_waiting_tokens,
        config.fair_share,
        config.max_loras,
    )


def build_runner(
    config: EngineConfig,
    model: DecoderLM,
    num_blocks: int,
    max_model_len: int,
    device: torch.device,
    dtype: torch.dtype,
) -> ModelRunner:
    """The target's runner, with CUDA graphs for decodes where its kernels can be captured."""
    runner = ModelRunner(model, num_blocks, config.block_size, device, dtype)
    if device.type == "cuda" and not config.enforce_eager:
        if model.kernels.graph_safe:
            runner.enable_decode_graphs(config.max_num_seqs, max_model_len)
        else:
            log.info("no CUDA graphs: the %s attention backend cannot be captured", model.kernels.name)
    return runner


def build_adapters(
    config: EngineConfig, models: Models, device: torch.device, dtype: torch.dtype
) -> Adapters | None:
    """The LoRA adapters this engine serves (--enable-lora, --lora-modules); None without --enable-lora."""
    if not config.enable_lora:
        return None
    modules = parse_lora_modules(config.lora_modules)
    max_cpu_loras = config.max_cpu_loras or config.max_loras
    adapters = Adapters(modules, models.target.spec, dtype, device, config.max_lora_rank, max_cpu_loras)
    log.info(
        "LoRA: %d adapters (%s), %d at a time in a step, %d in host memory",
        len(modules),
        ", ".join(modules) or "none yet",
        config.max_loras,
        max_cpu_loras,
    )
    return adapters


def build_proposers(
    config: EngineConfig,
    draft_model: DecoderLM | None,
    num_blocks: int,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[NgramProposer | None, DraftProposer | None]:
    """Speculative decoding's proposer, n-gram lookup or a draft model: at most one of the two."""
    if config.speculative_model == NGRAM:
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max), None
    if draft_model is not None:
        return None, DraftProposer(draft_model, num_blocks, config.block_size, device, dtype)
    return None, None


def build_kv_tiers(
    config: EngineConfig,
    models: Models,
    kv: KVCacheManager,
    kv_cache: torch.Tensor,
    device: torch.device,
    dtype: torch.dtype,
) -> KVTiers | None:
    """The tiers below the pool (--kv-offload-memory, --kv-offload-dir), the disk tier indexed from what an
    earlier run left; their coordinator exists whenever the prefix cache does, so peers can pull from the pool
    and this executor from peers. None without a prefix cache."""
    if not config.enable_prefix_caching:
        return None
    block_shape = tuple(kv_cache[:, :, 0].shape)
    fingerprint = KVFingerprint(
        model=model_identity(models.path),
        dtype=str(dtype).removeprefix("torch."),
        block_size=config.block_size,
        block_shape=block_shape,
        quantization=f"{config.quantization}/{config.quantized_activations}",
    )
    host = None
    if host_bytes := config.offload_bytes(device.type):
        host = HostTier(host_bytes, block_shape, dtype, pin=device.type == "cuda", shares=config.kv_shares)
        log.info("KV host tier: %d blocks (%.2f GiB)", host.index.num_blocks, host_bytes / 2**30)
    disk = None
    if config.kv_offload_dir:
        disk_bytes = config.kv_offload_disk if config.kv_offload_disk is not None else KV_OFFLOAD_DISK_BYTES
        disk = DiskTier(Path(config.kv_offload_dir), disk_bytes, fingerprint, dtype, config.kv_shares)
        found = disk.scan()
        log.info(
            "KV disk tier: %d blocks in %s (%.2f GiB), %d found from an earlier run",
            disk.index.num_blocks,
            config.kv_offload_dir,
            disk_bytes / 2**30,
            found,
        )
    admission = None
    if config.kv_offload_admission == "reuse":
        # remember first appearances for as many blocks as the pool and the tiers hold together
        tiers = [t for t in (host, disk) if t is not None]
        admission = ReuseAdmission(kv.pool.num_blocks + sum(t.index.num_blocks for t in tiers))
    return KVTiers(
        kv, kv_cache, fingerprint, host, disk, pull_timeout=config.kv_pull_timeout, admission=admission
    )


def log_kv_capacity(num_blocks: int, block_bytes: int, block_size: int, dtype, max_model_len: int) -> None:
    capacity = num_blocks * block_size
    log.info(
        "KV cache: %d blocks of %d tokens (%.2f GiB, %s) = %d tokens; %.1f requests of max_model_len %d fit",
        num_blocks,
        block_size,
        num_blocks * block_bytes / 2**30,
        dtype,
        capacity,
        capacity / max_model_len,
        max_model_len,
    )


def _max_model_len(asked: int | None, spec) -> int:
    """The model's context length, kept within a sliding window: attention here always sees the whole context,
    which equals sliding-window attention only while the context fits the window."""
    limit, what = spec.max_position, "context length"
    if spec.sliding_window is not None and spec.sliding_window < limit:
        limit, what = spec.sliding_window, "sliding window"
    if asked is None:
        return limit
    if asked > limit:
        raise ValueError(f"max_model_len {asked} exceeds the model's {what} {limit}")
    return asked


def _eos_token_ids(hf_config, model_path, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(source)
    try:
        gen = GenerationConfig.from_pretrained(model_path, local_files_only=True)
        eos = gen.eos_token_id
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    except OSError:
        pass  # no generation_config.json
    return frozenset(ids)
