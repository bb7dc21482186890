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


def _default_shaped_team(default_shaped_model) -> tuple[LLM, list[list[int]]]:
    """The default model's shapes with int8 weights (the team's), and prompts whose contexts decode attention cuts."""
    if not cpu_kernels().int8_dot_available():
        pytest.skip("the team needs int8 activations (AVX-512 VNNI)")
    llm = LLM(
        default_shaped_model,
        device="cpu",
        kv_cache_memory="64MiB",
        max_model_len=1536,
        quantization="int8",
        enable_prefix_caching=False,
    )
    g = torch.Generator().manual_seed(11)
    return llm, [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (300, 1100)]


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_a_stalled_team_thread_changes_no_bit_on_the_default_shapes(default_shaped_model, threads):
    """The team's last thread sleeps between computing work it claimed and keeping it, as a preempted thread does;
    the others do that work meanwhile and go on, and the late copies are dropped: on the default model's heads
    and MLP, with contexts cut into parts, greedy and seeded answers and their log-probabilities are the ones
    without stalls, and the layer loop's."""
    llm, prompts = _default_shaped_team(default_shaped_model)
    model = llm.engine.runner.model
    stack = model.decoder_stack
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, logprobs=2),
    ]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        calm = [_outputs(llm, p, prompts) for p in params]
        stack.set_team_wait_us(5)
        stack.set_team_stall(every=3, us=300)
        stalled = [_outputs(llm, p, prompts) for p in params]
        rescues = stack.team_rescues()
        model.decoder_stack = None
        looped = [_outputs(llm, p, prompts) for p in params]
    finally:
        torch.set_num_threads(before)
    assert threads == 1 or rescues > 0
    assert stalled == calm
    assert looped == calm


def test_an_exception_on_a_team_thread_is_raised_after_the_team(default_shaped_model, two_threads):
    """A fault inside the team's parallel region ends the step with an error (not the process); the next step
    runs, and gives the bits of one that never failed."""
    llm, prompts = _default_shaped_team(default_shaped_model)
    model = llm.engine.runner.model
    stack = model.decoder_stack
    steps = []
    original = stack.forward

    class Recording:
        def forward(self, *args):
            steps.append(args)
            return original(*args)

    model.decoder_stack = Recording()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    args = steps[-1]  # a step of decodes alone, which the team runs
    expected = original(*args)
    stack.set_team_throw(2)
    with pytest.raises(RuntimeError, match="set_team_throw"):
        original(*args)
    stack.set_team_throw(0)
    assert all(torch.equal(a, b) for a, b in zip(original(*args), expected, strict=True))


def test_a_model_with_qk_norm_keeps_the_layer_loop(tiny_models):
    llm = LLM(tiny_models["qwen3"], device="cpu", kv_cache_memory="16MiB", max_model_len=256)
    assert llm.engine.runner.model.decoder_stack is None
    assert len(llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4))[0].outputs[0].token_ids) == 4


def test_float32_weights_never_run_as_a_team(tiny_models):
    llm = LLM(tiny_models["llama"], device="cpu", kv_cache_memory="16MiB", max_model_len=256)
    assert llm.engine.runner.model.decoder_stack.team_rows() == 0
