"""--attention-backend: which kernels the engine gets, the errors where Triton cannot serve, and the same greedy
tokens from the Triton kernels as from the torch ones.

Without a CUDA device the Triton kernels run in Triton's interpreter, switched on before triton is imported."""

from __future__ import annotations

import argparse

import pytest
import torch

from tests.triton_interpreter import interpret_on_cpu_only_machines

INTERPRETING = interpret_on_cpu_only_machines(torch.cuda.is_available())

from executor import LLM, SamplingParams  # noqa: E402
from executor.engine_args import add_engine_args, config_from_args, engine_argv  # noqa: E402
from executor.engine_config import EngineConfig  # noqa: E402
from kvkernels import backend  # noqa: E402

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_picks_triton_on_cuda_and_torch_elsewhere(monkeypatch):
    monkeypatch.setattr(backend, "interpreting", lambda: False)
    assert backend.choose_kernels("auto", CPU).name == "torch"
    assert backend.choose_kernels("auto", CUDA).name == "triton"
    assert backend.choose_kernels("torch", CUDA).name == "torch"
    monkeypatch.setattr(backend, "triton_available", lambda: False)
    assert backend.choose_kernels("auto", CUDA).name == "torch"


def test_auto_never_picks_the_interpreter(monkeypatch):
    monkeypatch.setattr(backend, "interpreting", lambda: True)
    assert backend.choose_kernels("auto", CUDA).name == "torch"


def test_triton_on_cpu_without_the_interpreter_names_the_flag(monkeypatch):
    monkeypatch.setattr(backend, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="--attention-backend triton: Triton kernels run on CUDA devices"):
        backend.choose_kernels("triton", CPU)


def test_triton_without_the_package_names_the_flag(monkeypatch):
    monkeypatch.setattr(backend, "triton_available", lambda: False)
    with pytest.raises(ValueError, match="--attention-backend triton: the triton package is not installed"):
        backend.choose_kernels("triton", CUDA)


def test_flag_parses_round_trips_and_rejects_unknown_names():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = config_from_args(parser.parse_args(["--attention-backend", "torch"]))
    assert config.attention_backend == "torch"
    assert engine_argv(config) == ["--attention-backend", "torch"]
    with pytest.raises(ValueError, match="attention_backend must be auto, torch or triton"):
        EngineConfig(attention_backend="flash")


def test_engine_without_the_interpreter_refuses_triton_on_cpu_before_loading(monkeypatch):
    monkeypatch.setattr(backend, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="--attention-backend triton"):
        LLM("/nonexistent-model-dir", device="cpu", attention_backend="triton")


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # 16- and 32-dim heads, 2 query heads per KV head
def test_triton_backend_gives_the_torch_backends_greedy_tokens(tiny_models, family):
    device = "cuda" if torch.cuda.is_available() and not INTERPRETING else "cpu"
    # prompts longer than the step's token budget: prefill chunks over cached context share steps with decodes
    prompts = [list(range(5, 5 + n)) for n in (3, 21, 40)]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    outputs = {}
    for name in ("torch", "triton"):
        llm = LLM(
            tiny_models[family],
            device=device,
            dtype="float32",
            attention_backend=name,
            kv_cache_memory="8MiB",
            max_num_batched_tokens=16,
        )
        assert llm.engine.kernels.name == name
        outputs[name] = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    assert all(len(tokens) == 5 for tokens in outputs["triton"])
    assert outputs["triton"] == outputs["torch"]


def test_the_torch_backends_fused_add_norm_is_the_unfused_layer_and_matches_the_twin():
    from kvkernels import torch_twins

    torch.manual_seed(0)
    x, residual, weight = torch.randn(7, 64), torch.randn(7, 64), torch.rand(64) + 0.5
    normed, summed = backend.TORCH.add_rms_norm(x, residual, weight, 1e-6)
    # bit for bit what the layer computed before the add was fused (HF equivalence rests on it)
    assert torch.equal(summed, x + residual)
    assert torch.equal(normed, torch.nn.functional.rms_norm(x + residual, (64,), weight, 1e-6))
    twin_normed, twin_summed = torch_twins.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(summed, twin_summed)
    torch.testing.assert_close(normed, twin_normed)
