"""The Triton backend serves LoRA adapters with the torch backend's greedy tokens: its shrink and expand kernels
(kvkernels/triton_lora.py) run inside the model, on the rows and projections the engine hands them, in one batch
of the base model and several adapters. In Triton's interpreter where no CUDA device exists."""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import interpret_on_cpu_only_machines

INTERPRETING = interpret_on_cpu_only_machines(torch.cuda.is_available())
pytest.importorskip("triton")

from executor import LLM, SamplingParams  # noqa: E402
from tests.executor.lora.conftest import ADAPTERS  # noqa: E402


def test_triton_backend_gives_the_torch_backends_greedy_tokens_under_adapters(tiny_models, adapters):
    device = "cuda" if torch.cuda.is_available() and not INTERPRETING else "cpu"
    names = [None, *ADAPTERS]
    # prompts longer than the step's token budget: prefill chunks under adapters share steps with decodes
    prompts = [list(range(7 + i, 7 + i + n)) for i, n in enumerate((3, 18, 5, 2))]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            tiny_models["llama"],
            device=device,
            dtype="float32",
            attention_backend=backend,
            kv_cache_memory="8MiB",
            max_num_batched_tokens=16,
            quantization="none",
            enable_lora=True,
            lora_modules={name: paths[0] for name, paths in adapters.items()},
            max_loras=len(ADAPTERS),
        )
        outs = llm.generate(prompts, params, lora=names)
        outputs[backend] = [out.outputs[0].token_ids for out in outs]
    assert outputs["triton"] == outputs["torch"]
    assert len(set(map(tuple, outputs["torch"]))) == len(names), "adapters that change nothing test nothing"
