"""The C++ decoder stack (kvkernels/decoder_stack.py) runs a step of decodes in one call: it must give the Python
layer loop's results bit for bit, float32 and quantized, with qkv biases, and stand aside where it cannot serve."""

from __future__ import annotations

import pytest
import torch

from executor import LLM, SamplingParams
from kvkernels.cpu_extension import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels are not built here")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a", "1, 2, 3,"]


@pytest.fixture
def two_threads():
    """The team runs where torch has two threads or more, which a test worker of xdist does not (one each)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _outputs(llm: LLM, params: SamplingParams, prompts: list[str]) -> list[tuple[list[int], list]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]


@pytest.mark.parametrize(
    ("family", "quantization", "prompts", "activations"),
    [
        ("llama", "none", 4, "int8"),
        ("llama", "int8", 4, "int8"),
        ("llama", "int8", 1, "int8"),
        ("qwen2", "int8", 4, "int8"),
        ("llama", "int8", 4, "int16"),
        ("llama", "int8", 1, "int16"),
    ],
)
def test_decode_steps_through_the_stack_equal_the_layer_loop(
    tiny_models, family, quantization, prompts, activations, two_threads
):
    """int8 weights with int8 (or int16) activations run on one team of threads (forward_team) up to its rows, the
    rest one parallel region an operation: both must give the layer loop's bits, one sequence (whose attention is
    cut into parts of its context) and several."""
    llm = LLM(
        tiny_models[family],
        device="cpu",
        kv_cache_memory="16MiB",
        max_model_len=256,
        quantization=quantization,
        quantized_activations=activations,
        enable_prefix_caching=False,
    )
    model = llm.engine.runner.model
    stack = model.decoder_stack
    assert stack is not None
    calls = []
    original = stack.forward

    class Counting:
        def forward(self, *args):
            calls.append(args[0].shape[0])
            return original(*args)

    model.decoder_stack = Counting()
    # greedy with each token's log-probabilities, and seeded sampling: any difference in a logit shows
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True, logprobs=2),
    ]
    chosen = PROMPTS[:prompts]
    fused = [_outputs(llm, p, chosen) for p in params]
    assert calls and max(calls) == len(chosen)  # the sequences decoded together, through the stack
    if quantization == "int8" and cpu_kernels().int8_dot_available():
        assert stack.team_rows() >= len(chosen)
    model.decoder_stack = None
    assert [_outputs(llm, p, chosen) for p in params] == fused


def test_work_done_twice_by_the_team_gives_the_same_bits(tiny_models, two_threads):
    """A team thread that waits no time for another's claimed panels and attention items does them as well, and
    the other writes them again when it gets there: the results must stay the layer loop's."""
    if not cpu_kernels().int8_dot_available():
        pytest.skip("the team needs int8 activations (AVX-512 VNNI)")
    llm = LLM(
        tiny_models["llama"],
        device="cpu",
        kv_cache_memory="16MiB",
        max_model_len=256,
        quantization="int8",
        enable_prefix_caching=False,
    )
    model = llm.engine.runner.model
    stack = model.decoder_stack
    stack.set_team_wait_us(0)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    teamed = _outputs(llm, params, PROMPTS[:2])
    assert stack.team_rescues() > 0
    model.decoder_stack = None
    assert _outputs(llm, params, PROMPTS[:2]) == teamed


def test_a_model_with_qk_norm_keeps_the_layer_loop(tiny_models):
    llm = LLM(tiny_models["qwen3"], device="cpu", kv_cache_memory="16MiB", max_model_len=256)
    assert llm.engine.runner.model.decoder_stack is None
    assert len(llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4))[0].outputs[0].token_ids) == 4


def test_float32_weights_never_run_as_a_team(tiny_models):
    llm = LLM(tiny_models["llama"], device="cpu", kv_cache_memory="16MiB", max_model_len=256)
    assert llm.engine.runner.model.decoder_stack.team_rows() == 0
