"""The C++ decoder stack (kvkernels/decoder_stack.py) runs a step of decodes in one call: it must give the Python
layer loop's results bit for bit, float32 and quantized, with qkv biases, and stand aside where it cannot serve."""

from __future__ import annotations

import pytest

from executor import LLM, SamplingParams
from kvkernels.cpu_extension import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels are not built here")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a", "1, 2, 3,"]


def _outputs(llm: LLM, params: SamplingParams) -> list[tuple[list[int], list]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize(
    ("family", "quantization"), [("llama", "none"), ("llama", "int8"), ("qwen2", "int8")]
)
def test_decode_steps_through_the_stack_equal_the_layer_loop(tiny_models, family, quantization):
    llm = LLM(
        tiny_models[family],
        device="cpu",
        kv_cache_memory="16MiB",
        max_model_len=256,
        quantization=quantization,
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
    fused = [_outputs(llm, p) for p in params]
    assert calls and max(calls) == len(PROMPTS)  # the four sequences decoded together, through the stack
    model.decoder_stack = None
    assert [_outputs(llm, p) for p in params] == fused


def test_a_model_with_qk_norm_keeps_the_layer_loop(tiny_models):
    llm = LLM(tiny_models["qwen3"], device="cpu", kv_cache_memory="16MiB", max_model_len=256)
    assert llm.engine.runner.model.decoder_stack is None
    assert len(llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4))[0].outputs[0].token_ids) == 4
