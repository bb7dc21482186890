"""How many bytes become KV blocks: --kv-cache-memory outright, or on CUDA a share of the device after a
profiling step has shown what weights and activations need."""

from __future__ import annotations

import dataclasses
import logging

import torch

from executor.engine_config import EngineConfig
from executor.kv.layout import kv_cache_shape, layer_caches
from executor.model_runner import PROMPT_LOGITS_ROWS
from executor.models.llama import AttentionBatch, DecoderLM
from executor.sampling.sampler import Sampler, SamplingRow, logprobs_of
from executor.sampling.sampling_state import SamplingState
from shared.sampling_params import MAX_LOGPROBS, MAX_PROMPT_LOGPROBS, SamplingParams

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


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the tensors the model holds, each storage once: parameters, buffers, and the packed or
    quantized weights its layers keep as plain attributes (they count as served, so smaller weights leave more
    of the device to KV)."""
    storages: dict[int, int] = {}

    def visit(value) -> None:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for field in dataclasses.fields(value):
                visit(getattr(value, field.name))
        elif isinstance(value, tuple | list):
            for item in value:
                visit(item)

    for module in model.modules():
        for value in (*module._parameters.values(), *module._buffers.values(), *vars(module).values()):
            visit(value)
    return sum(storages.values())


def kv_cache_bytes(config: EngineConfig, model: DecoderLM, device: torch.device, dtype: torch.dtype) -> int:
    if config.kv_cache_memory is not None:
        return int(config.kv_cache_memory)
    if device.type != "cuda":
        return CPU_DEFAULT_KV_BYTES
    return profile_kv_bytes(config, model, device, dtype, torch.cuda)


def worst_sampling_params(vocab_size: int) -> SamplingParams:
    """A request whose sampling holds the most memory: every filter and penalty, the most logprobs, and a
    logit_bias (a dense row of the vocabulary for as long as it runs)."""
    return SamplingParams(
        temperature=0.7,
        top_k=50,
        top_p=0.9,
        min_p=0.01,
        repetition_penalty=1.1,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        logprobs=MAX_LOGPROBS,
        logit_bias={vocab_size - 1: 1.0},
    )


@torch.inference_mode()
def profile_kv_bytes(
    config: EngineConfig,
    model: DecoderLM,
    device: torch.device,
    dtype: torch.dtype,
    memory,
) -> int:
    """gpu_memory_utilization x device memory, minus what others hold, weights and the peak of the worst step,
    run with the model's kernels, which will serve (their scratch memory differs). memory is torch.cuda (a stand-in in
    tests): mem_get_info, memory_reserved, max_memory_allocated and their resets.

    The worst step: a full token budget through the model, then every logits row a step can hold at once:
    max_num_seqs x (1 + proposals) sampled with every filter, penalty and the most logprobs, alongside one
    slice of prompt logprobs (PROMPT_LOGITS_ROWS, the most the step computes at a time)."""
    memory.empty_cache()
    memory.reset_peak_memory_stats(device)
    free, total = memory.mem_get_info(device)
    held_by_others = (total - free) - memory.memory_reserved(device)
    spec = model.spec
    n = config.max_num_batched_tokens
    bs = config.block_size
    num_blocks = -(-n // bs)
    scratch = torch.zeros(kv_cache_shape(spec, num_blocks, bs), dtype=dtype, device=device)
    caches = layer_caches(scratch)
    positions = torch.arange(n, device=device)
    batch = AttentionBatch(
        slot_mapping=positions,
        block_table=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
    )
    input_ids = torch.zeros(n, dtype=torch.int64, device=device)
    hidden = model(input_ids, positions, caches, batch)
    num_sampled = config.max_num_seqs * (1 + config.num_speculative_tokens)
    logits = model.compute_logits(hidden[-min(n, num_sampled) :])
    prompt_hidden = hidden[: min(n, PROMPT_LOGITS_ROWS)].clone()
    del hidden
    num_prompt = prompt_hidden.shape[0]
    logprobs_of(
        model.compute_logits(prompt_hidden), input_ids[:num_prompt], [MAX_PROMPT_LOGPROBS] * num_prompt
    )
    params = worst_sampling_params(spec.vocab_size)
    rows = [SamplingRow(SamplingState.of(params, [0]), None) for _ in range(logits.shape[0])]
    Sampler()(logits, rows)
    memory.synchronize(device)
    peak = memory.max_memory_allocated(device) - scratch.numel() * scratch.element_size()
    del scratch, caches, logits, prompt_hidden, rows
    memory.empty_cache()
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
