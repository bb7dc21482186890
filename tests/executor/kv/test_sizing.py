"""GPU memory profiling (executor/kv/sizing.py) on the CPU, with torch.cuda's memory calls played by a stand-in
that counts the bytes of live tensors: the budget is the device's share less what others hold and the profiled
peak, and that peak covers the worst steps the engine then runs (a whole chunk of prompt logprobs; every row
sampling with every filter and the most logprobs)."""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from executor import LLM, SamplingParams
from executor.engine_config import EngineConfig
from executor.kv.layout import kv_block_bytes
from executor.kv.sizing import kv_cache_bytes, profile_kv_bytes, worst_sampling_params
from shared.sampling_params import MAX_PROMPT_LOGPROBS

GIB = 2**30


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage alive among the tensors ops made while it was on, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.holders: dict[int, list[int]] = {}  # storage address -> [bytes, tensors alive on it]
        self.seen: dict[int, weakref.ref] = {}  # id(tensor) -> the tensor, once counted
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._count(tensor)
        return out

    def reset_peak(self) -> None:
        self.peak = self.now

    def _count(self, tensor: torch.Tensor) -> None:
        known = self.seen.get(id(tensor))
        if known is not None and known() is tensor:
            return
        storage = tensor.untyped_storage()
        address, size = storage.data_ptr(), storage.nbytes()
        if size == 0:
            return
        self.seen[id(tensor)] = weakref.ref(tensor)
        holder = self.holders.get(address)
        if holder is None:
            holder = self.holders[address] = [size, 0]
            self.now += size
            self.peak = max(self.peak, self.now)
        holder[1] += 1
        weakref.finalize(tensor, self._release, address, id(tensor))

    def _release(self, address: int, tensor_id: int) -> None:
        self.seen.pop(tensor_id, None)
        holder = self.holders[address]
        holder[1] -= 1
        if holder[1] == 0:
            del self.holders[address]
            self.now -= holder[0]


class FakeCudaMemory:
    """torch.cuda's memory calls for a device of `total` bytes, `others` of them held by other processes, on
    which `resident` bytes (the weights) were allocated before and `live` counts the rest."""

    def __init__(self, live: LiveBytes, total: int, others: int, resident: int) -> None:
        self.live, self.total, self.others, self.resident = live, total, others, resident
        self.calls: list[str] = []

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")

    def reset_peak_memory_stats(self, device) -> None:
        self.calls.append("reset_peak_memory_stats")
        self.live.reset_peak()

    def mem_get_info(self, device) -> tuple[int, int]:
        return self.total - self.others - self.memory_reserved(device), self.total

    def memory_reserved(self, device) -> int:
        return self.resident + self.live.now

    def max_memory_allocated(self, device) -> int:
        return self.resident + self.live.peak

    def synchronize(self, device) -> None:
        self.calls.append("synchronize")


@pytest.fixture(scope="module")
def llm(tiny_models):
    """The tiny model (the default model's 49k vocabulary) with a small step, so the worst steps stay cheap."""
    return LLM(
        tiny_models["llama"],
        device="cpu",
        kv_cache_memory="8MiB",
        max_num_batched_tokens=512,
        max_num_seqs=16,
    )


def _profile(llm: LLM, live: LiveBytes, **config) -> tuple[int, FakeCudaMemory, int]:
    """(the KV budget, the stand-in, the scratch KV the profile ran over)."""
    engine = llm.engine
    model = engine.runner.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    memory = FakeCudaMemory(live, total=4 * GIB, others=GIB, resident=weights)
    config = EngineConfig(
        **{"max_num_batched_tokens": 512, "max_num_seqs": 16, "gpu_memory_utilization": 0.5, **config}
    )
    spec = model.spec
    scratch = kv_block_bytes(spec, config.block_size, torch.float32) * (512 // config.block_size)
    with live:
        budget = profile_kv_bytes(config, model, torch.device("cpu"), torch.float32, memory)
    return budget, memory, scratch


def test_the_budget_is_the_share_less_others_weights_and_the_peak(llm):
    live = LiveBytes()
    budget, memory, scratch = _profile(llm, live)
    activations = live.peak - scratch
    assert budget == 2 * GIB - GIB - memory.resident - activations
    assert memory.calls[:2] == ["empty_cache", "reset_peak_memory_stats"] and "synchronize" in memory.calls
    # the peak holds the sampled rows' logits and the prompt slice's, each with at least one copy
    vocab = llm.engine.vocab_size
    assert activations > (16 + 256) * vocab * 4 * 2
    assert live.now == 0  # nothing of the profile stays behind


def test_the_budget_covers_the_worst_steps_the_engine_runs(llm):
    live = LiveBytes()
    budget, memory, scratch = _profile(llm, live)
    profiled = live.peak - scratch
    vocab = llm.engine.vocab_size
    worst = worst_sampling_params(vocab)
    steps = {
        # a full chunk whose every position reports prompt logprobs
        "prompt logprobs": ([[7] * 512], SamplingParams(max_tokens=1, prompt_logprobs=MAX_PROMPT_LOGPROBS)),
        # every place of the batch sampling with every filter, penalty and the most logprobs
        "sampling": ([[5 + i, 9, 11] for i in range(16)], dataclasses.replace(worst, max_tokens=3)),
    }
    for name, (prompts, params) in steps.items():
        live = LiveBytes()
        with live:
            outputs = llm.generate(prompts, params)
        assert all(o.outputs[0].token_ids for o in outputs)
        assert live.peak <= profiled, (
            f"{name}: {live.peak / 2**20:.0f} MiB over the profiled {profiled / 2**20:.0f}"
        )


def test_profiling_runs_on_cuda_only_and_an_explicit_size_wins(llm):
    model, cpu = llm.engine.runner.model, torch.device("cpu")
    assert kv_cache_bytes(EngineConfig(kv_cache_memory="3GiB"), model, cpu, torch.float32) == 3 * GIB
    assert kv_cache_bytes(EngineConfig(), model, cpu, torch.float32) == 4 * GIB  # vLLM's CPU default


def test_too_little_memory_names_the_flag(llm):
    live = LiveBytes()
    with pytest.raises(ValueError, match="gpu_memory_utilization 0.01 leaves no memory for the KV cache"):
        _profile(llm, live, gpu_memory_utilization=0.01)
