"""--quantization: the engine serving int8 and fp8 weights quantized at load time, greedy tokens of int8 against
float32 on the default model, the weights' bytes as the KV sizing counts them, and the flag's errors."""

from __future__ import annotations

import argparse
import gc

import pytest
import torch

from executor import LLM, SamplingParams
from executor.engine_args import add_engine_args, config_from_args
from executor.engine_config import EngineConfig
from executor.kv.sizing import profile_kv_bytes, weight_bytes
from kvkernels.cpu_extension import cpu_kernels
from kvkernels.quantized import ACTIVATION_PLANES, QuantizedLinear
from kvkernels.weight_quantization import Fp8Linear, TiedEmbedding, fp8_matmul_available
from tests.executor.kv.test_sizing import GIB, FakeCudaMemory, LiveBytes

# a fixed prompt set; greedy int8 tokens are compared with float32's on the default model
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "The three primary colors are",
    "Once upon a time, there was a",
    "To make a cup of tea, first",
    "The largest planet in the solar system is",
    "import numpy as np\n\narray =",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _llm(model: str, **args) -> LLM:
    return LLM(
        model, device="cpu", kv_cache_memory="16MiB", max_num_batched_tokens=256, max_model_len=256, **args
    )


def _held_bytes() -> int:
    """Bytes of every tensor storage alive in this process."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu":
            storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    return sum(storages.values())


@pytest.fixture(scope="module")
def tied(tiny_models) -> tuple[dict[str, LLM], dict[str, int]]:
    """qwen2's tiny model (its embeddings tied to the head) served float32 and int8 with a scale per 32 inputs, and
    the bytes of tensors each engine's start left held. Both engines are kept: one freed would count against the
    other."""
    held, llms = {}, {}
    for quantization, group in (("none", None), ("int8", 32)):
        before = _held_bytes()
        llms[quantization] = _llm(
            tiny_models["qwen2"], quantization=quantization, quantization_group_size=group
        )
        held[quantization] = _held_bytes() - before
    return llms, held


def test_int8_serves_a_tied_model(tied):
    """Every linear layer is quantized, the head too, and the embedding table reads the head's rows."""
    plain, int8 = tied[0]["none"], tied[0]["int8"]
    model = int8.engine.runner.model
    assert isinstance(model.lm_head, QuantizedLinear) and isinstance(model.model.embed_tokens, TiedEmbedding)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    # a random model's next tokens are near ties among a 49k vocabulary: compare the first step's top logprobs
    first = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    want = plain.generate([[11, 22, 33, 44]], first)[0].outputs[0]
    got = int8.generate([[11, 22, 33, 44]], first)[0].outputs[0]
    assert len(got.token_ids) == 8
    want_top, got_top = dict(want.logprobs[0].top), dict(got.logprobs[0].top)
    assert set(got_top) == set(want_top)
    assert all(abs(got_top[t] - want_top[t]) < 0.1 for t in want_top), (got_top, want_top)


def test_int8_weights_leave_more_memory_to_the_kv_pool(tied):
    """No float copy of a quantized weight stays behind: the process holds weight_bytes' difference less, and the
    GPU profile (the allocator's peak, which the weights as served are part of) leaves that much more to KV."""
    llms, held = tied
    models = {quantization: llm.engine.runner.model for quantization, llm in llms.items()}
    plain, int8 = weight_bytes(models["none"]), weight_bytes(models["int8"])
    assert int8 < 0.3 * plain  # a byte and an eighth a weight against four (norms and biases stay float32)
    assert abs((held["none"] - held["int8"]) - (plain - int8)) < 0.02 * plain
    budgets = {}
    for quantization, model in models.items():
        config = EngineConfig(max_num_batched_tokens=64, max_num_seqs=4, gpu_memory_utilization=0.5)
        memory = FakeCudaMemory(LiveBytes(), total=4 * GIB, others=GIB, resident=weight_bytes(model))
        with memory.live:
            budgets[quantization] = profile_kv_bytes(
                config, model, torch.device("cpu"), torch.float32, memory
            )
    assert budgets["int8"] - budgets["none"] > 0.9 * (plain - int8)


def test_fp8_emulated_on_the_cpu_serves_tokens(tiny_models):
    llm = _llm(tiny_models["llama"], quantization="fp8")
    model = llm.engine.runner.model
    assert isinstance(model.lm_head, Fp8Linear) and model.lm_head.weight_fp8.dtype == torch.float8_e4m3fn
    assert isinstance(model.model.embed_tokens, torch.nn.Embedding)  # untied: its table stays as it was
    outputs = llm.generate([[11, 22, 33, 44]], GREEDY)
    assert len(outputs[0].outputs[0].token_ids) == 8


@pytest.mark.skipif(
    not torch.cuda.is_available() or not fp8_matmul_available(torch.device("cuda")),
    reason="torch's fp8 scaled matmul needs a CUDA device of compute capability 9.0 or later",
)
def test_fp8_scaled_matmul_on_hopper_matches_the_dequantized_product():
    linear = torch.nn.Linear(256, 512, bias=True, device="cuda", dtype=torch.bfloat16)
    layer = Fp8Linear(linear)
    x = torch.randn(33, 256, device="cuda", dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(x.float(), layer.dequantize(torch.float32), linear.bias.float())
    got = layer(x)
    assert got.dtype == torch.bfloat16 and layer._scaled
    # the activations are rounded to e4m3 per token too: about 2^-4 of each product
    assert (got.float() - expected).norm() / expected.norm() < 0.05


def test_int8_greedy_tokens_match_float32_on_the_default_model(default_model):
    """The report's figure: of the 8 prompts, how many produce float32's 8 greedy tokens exactly under int8 with a
    scale per output row (when written: 6 with float32 activations, the other two parting at a near tie at the
    2nd and 4th token; 5 with int8 activations, this machine's default)."""
    outputs = {}
    for quantization in ("none", "int8"):
        llm = _llm(default_model, quantization=quantization)
        outputs[quantization] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        del llm
    same = sum(a == b for a, b in zip(outputs["none"], outputs["int8"], strict=True))
    print(f"int8 greedy tokens equal to float32's on {same} of {len(PROMPTS)} prompts")
    assert same >= 5


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--quantization", "int4"], "invalid choice: 'int4'"),
        (["--quantization", "fp8", "--quantization-group-size", "32"], "applies to quantization int8"),
        (["--quantization", "int8", "--quantization-group-size", "0"], "at least 1"),
        (["--quantized-activations", "int4"], "quantized-activations: invalid choice: 'int4'"),
    ],
)
def test_bad_values_name_the_flag(argv, error, capsys):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    with pytest.raises((SystemExit, ValueError)) as raised:
        config_from_args(parser.parse_args(argv))
    message = str(raised.value) if raised.type is ValueError else capsys.readouterr().err
    assert error in message and "quantiz" in message
    with pytest.raises(ValueError, match="quantization must be one of auto, none, int8, fp8, got 'q4'"):
        EngineConfig(quantization="q4")
    with pytest.raises(
        ValueError, match="quantized_activations must be one of int8, int16, float32, got 'fp16'"
    ):
        EngineConfig(quantized_activations="fp16")


@pytest.mark.parametrize("activations", ["int8", "int16", "float32"])
def test_quantized_activations_choose_how_the_packed_gemm_multiplies(tiny_models, activations):
    """int8 (default) and int16 where the CPU has VNNI and the groups are whole blocks of 32; float32 always where
    asked. Either way the layers serve tokens."""
    llm = _llm(
        tiny_models["llama"],
        quantization="int8",
        quantization_group_size=32,
        quantized_activations=activations,
    )
    packed = [m._panels for m in llm.engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
    if not packed or packed[0] is None:
        pytest.skip("the C++ CPU kernels could not be built here")
    planes = ACTIVATION_PLANES[activations] if cpu_kernels().int8_dot_available() else 0
    assert all(p.activation_planes == planes for p in packed)
    out = llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0]
    assert len(out.token_ids) == GREEDY.max_tokens


@pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels are not built here")
@pytest.mark.parametrize("activations", ["int8", "int16"])
def test_quantized_activations_give_the_same_greedy_tokens_on_one_thread_as_on_two(tiny_models, activations):
    """A row's activations are quantized alone and each panel's arithmetic is the same on any thread, so the
    thread governor (executor/cpu_threads.py) may move the count without moving an answer; decodes of one and of
    several sequences, through the decoder stack's team and the layer loop."""
    llm = _llm(
        tiny_models["llama"],
        quantization="int8",
        quantization_group_size=32,
        quantized_activations=activations,
    )
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    prompts = [[5, 6, 7], list(range(40, 90)), [9] * 12]
    threads = torch.get_num_threads()
    answers = []
    try:
        for n in (2, 1):
            torch.set_num_threads(n)
            alone = [llm.generate([p], params)[0].outputs[0] for p in prompts]
            together = [o.outputs[0] for o in llm.generate(prompts, params)]
            answers.append([(o.token_ids, o.logprobs) for o in alone + together])
    finally:
        torch.set_num_threads(threads)
    assert answers[0] == answers[1]


def test_a_group_size_that_does_not_divide_a_layer_is_refused(tiny_models):
    with pytest.raises(ValueError, match="--quantization-group-size 48 does not divide"):
        _llm(tiny_models["llama"], quantization="int8", quantization_group_size=48)
