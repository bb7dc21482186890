"""bench/gpu/image.py: which packages the GPU image lacks (tests/bench/gpu/test_session.py runs the GPU
session's dry run with those made unimportable), and its blocker's error."""

from __future__ import annotations

import os
import subprocess
import sys

from bench.gpu import image


def test_the_image_lacks_the_gateways_and_grammars_libraries_but_has_the_engines():
    missing = set(image.missing_modules())
    assert {"xgrammar", "zmq", "redis", "starlette", "uvicorn", "opentelemetry", "gguf"} <= missing
    present = {"torch", "triton", "transformers", "numpy", "msgpack", "safetensors", "tokenizers", "jinja2"}
    assert not present & missing
    assert not {"executor", "kvkernels", "shared", "bench", "gateway"} & missing  # ours travel with the call


def test_the_blocker_raises_the_error_a_missing_package_raises_and_probes_find_nothing(tmp_path):
    """transformers 5.25 imports Hugging Face's kernels, which probes for tvm_ffi with find_spec: a probe that
    raised instead of finding nothing failed every import of transformers in the dry run."""
    site = image.write_site(tmp_path / "site")
    probe = (
        "import importlib.util, torch, triton, transformers\n"
        "assert importlib.util.find_spec('zmq') is None and importlib.util.find_spec('zmq.sugar') is None\n"
        "assert importlib.util.find_spec('torch') is not None\n"
        "try:\n    import zmq\nexcept ModuleNotFoundError as e:\n    print(e.name, e)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.strip() == "zmq No module named 'zmq' (the GPU image has no such package)", done.stderr
