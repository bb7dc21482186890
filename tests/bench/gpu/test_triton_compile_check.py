"""bench.gpu.triton_compile_check: every Triton launch the engine makes compiles to an sm_90 cubin, with the venv's
Triton and with the GPU image's (older), each launch specialised as Triton's launcher specialises it.

The check runs in a subprocess: Triton compiles only where TRITON_INTERPRET was unset when it was first imported,
and this process may have imported it to interpret (tests/kernels/test_triton_attention.py).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu import image_triton

ROOT = Path(__file__).resolve().parents[3]
KERNELS = (
    "_attention_kernel",
    "_combine_splits_kernel",
    "_reshape_and_cache_kernel",
    "_rms_norm_kernel",
    "_rotary_kernel",
    "_shrink_kernel",
    "_expand_kernel",
)


def _venv_triton() -> tuple[dict[str, str], str]:
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("the venv's triton has no CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return env, importlib.metadata.version("triton")


def _image_triton() -> tuple[dict[str, str], str]:
    if not image_triton.installed():
        pytest.fail(
            f"the GPU image's Triton {image_triton.VERSION} is not in {image_triton.DIRECTORY}: "
            f"`{image_triton.INSTALL_COMMAND}` installs it"
        )
    return image_triton.environ(), image_triton.VERSION


@pytest.fixture(scope="module", params=[_venv_triton, _image_triton], ids=["venv-triton", "image-triton"])
def compiled(request) -> list[str]:
    """The check's lines for the engine's launches (--quick: the full set takes 35-50 s a Triton here)."""
    env, version = request.param()
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu.triton_compile_check", "--arch", "90", "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-1].endswith(f"for sm_90 with Triton {version}"), done.stdout
    return lines


def test_every_engine_launch_compiles_to_a_cubin(compiled):
    for kernel in KERNELS:
        assert any(line.startswith(kernel + " ") for line in compiled), "\n".join(compiled)


def test_launches_are_specialised_as_the_launcher_specialises_them(compiled):
    """An int argument equal to 1 is compiled as a constant (gone from the kernel's arguments in its TTIR), and
    only ints not divisible by 16 lack tt.divisibility = 16: strides, pointers and a batch of 16 have it."""
    attention = {line.rsplit("; ", 1)[1]: line for line in compiled if line.startswith("_attention_kernel ")}
    assert (
        "; constants num_seqs=1 stride_bt=1; not divisible by 16: -;"
        in (attention["eager decode of 1 sequence in its first block"])
    )
    # a CUDA graph's padded batch of one sequence, its block table as wide as max_model_len
    assert (
        "; constants num_seqs=1; not divisible by 16: -;"
        in attention["decode graph of 1 at max_model_len 2048"]
    )
    assert "; constants -; not divisible by 16: -;" in attention["decode graph of 16 at max_model_len 2048"]
    mixed = attention["a 30-token chunk beside 2 decodes, table 44 wide"]
    assert "; constants -; not divisible by 16: num_seqs stride_bt;" in mixed
