"""bench/gpu_image: which packages the GPU image lacks, and the engine serving with those made unimportable (a
structured-outputs request then refused, naming the library)."""

from __future__ import annotations

import os
import subprocess
import sys

from bench import gpu_image


def test_the_image_lacks_the_gateways_and_grammars_libraries_but_has_the_engines():
    missing = set(gpu_image.missing_modules())
    assert {"xgrammar", "zmq", "redis", "starlette", "uvicorn", "opentelemetry", "gguf"} <= missing
    present = {"torch", "triton", "transformers", "numpy", "msgpack", "safetensors", "tokenizers", "jinja2"}
    assert not present & missing
    assert not {"executor", "kernels", "shared", "bench", "gateway"} & missing  # ours travel with the call


SERVE = """
import sys
from executor import LLM, SamplingParams
from shared.structured_outputs import StructuredOutputsParams

try:
    import xgrammar
    sys.exit("xgrammar imported")
except ImportError:
    pass
llm = LLM(sys.argv[1], device="cpu", kv_cache_memory="8MiB")
out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
print("tokens", len(out[0].outputs[0].token_ids))
try:
    llm.generate([[5, 6]], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a+")))
except ValueError as error:
    print("refused:", error)
print("after", len(llm.generate([[8, 9]], SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids))
"""


def test_the_engine_serves_with_only_the_images_packages(tiny_models, tmp_path):
    site = gpu_image.write_site(tmp_path / "site")
    done = subprocess.run(
        [sys.executable, "-c", SERVE, tiny_models["llama"]],
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "tokens 4" and lines[-1] == "after 2"
    assert lines[1].startswith("refused: structured_outputs:") and "pip install xgrammar" in lines[1]
