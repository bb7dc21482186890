"""bench/gpu/kernel_checks.py: check.py's kernels section at toy sizes (in Triton's interpreter on CPU where no CUDA
device exists, on the GPU otherwise): every kernel held to its twin, a case that raises reported while the next
still runs, LoRA's update caught when it is wrong, and the fp8 layer held to its dequantized product."""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import interpret_on_cpu_only_machines

INTERPRETING = interpret_on_cpu_only_machines(torch.cuda.is_available())
pytest.importorskip("triton")

from bench.gpu import kernel_checks  # noqa: E402
from bench.gpu.report import problems  # noqa: E402

DEVICE = "cpu" if INTERPRETING else "cuda"


def test_a_kernel_case_that_raises_is_reported_and_the_next_still_runs(monkeypatch):
    measure = kernel_checks.kernel_error

    def rms_norm_raises(kernel, case, dtype, device):
        if kernel == "rms_norm":
            raise ValueError("no kernel for this shape")
        return measure(kernel, case, dtype, device)

    monkeypatch.setattr(kernel_checks, "kernel_error", rms_norm_raises)
    cases = kernel_checks.TOY_ATTENTION_CASES
    rows = list(kernel_checks.correctness(DEVICE, cases, {torch.float32: 2e-5}, []))
    kernels = [row["kernel"] for row in rows][-4:]
    assert kernels == ["rms_norm", "add_rms_norm", "rotary_embedding", "lora_add"]
    failed = [row for row in rows if not row["ok"]]
    assert [row["kernel"] for row in failed] == ["rms_norm"] and "no kernel" in failed[0]["error"]
    assert problems({"correctness": rows}) == ["1 of 6 kernel cases failed"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_add_is_held_to_its_twin_and_a_wrong_update_is_caught(dtype, monkeypatch):
    assert kernel_checks.kernel_error("lora_add", None, dtype, DEVICE) <= kernel_checks.TOLERANCE[dtype]
    from kvkernels import triton_lora

    add = triton_lora.lora_add

    def first_group_only(x, out, groups):  # as a kernel that dropped every group after the first would
        add(x, out, groups[:1])

    monkeypatch.setattr(triton_lora, "lora_add", first_group_only)
    assert kernel_checks.kernel_error("lora_add", None, dtype, DEVICE) > 10 * kernel_checks.TOLERANCE[dtype]


def test_fp8_layer_is_held_to_its_dequantized_product():
    """Emulated off a Hopper GPU (the dequantized weights with bf16 activations: within the tolerance by far); on
    one through torch's scaled matmul, which a CUDA row must have used to pass."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = list(kernel_checks.fp8_correctness(device, kernel_checks.TOY_FP8_CASES))
    assert [row["kernel"] for row in rows] == ["fp8_linear/1x64x32", "fp8_linear/17x64x48"]
    assert all(row["ok"] and row["dtype"] == "float8_e4m3fn" for row in rows), rows
    assert all(0 < row["max_error"] < kernel_checks.FP8_TOLERANCE for row in rows)
