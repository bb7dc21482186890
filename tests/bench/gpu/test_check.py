"""bench/gpu/check.py: its arithmetic and arguments, its refusal where it cannot run, its report file rewritten row by
row, and its kernel sections at toy sizes (in Triton's interpreter on CPU where no CUDA device exists, on the GPU
otherwise). The engine sections run in test_e2e and in session.sh's dry run (test_session)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.triton_interpreter import interpret_on_cpu_only_machines

INTERPRETING = interpret_on_cpu_only_machines(torch.cuda.is_available())

from bench.gpu import check, kernel_checks  # noqa: E402
from bench.gpu.report import render  # noqa: E402


def test_help_runs_without_a_gpu():
    done = subprocess.run([sys.executable, "-m", "bench.gpu.check", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "--peak-gbps" in done.stdout


def test_defaults_are_the_issues_workload():
    args = check.parse_args([])
    assert args.section == "all"
    assert (args.decode_batch, args.decode_context) == (64, 2048)
    assert args.concurrency == [1, 64, 256]
    assert args.throughput_backends == ["triton", "triton-eager", "triton+fp8"]
    assert (args.prompt_len, args.output_len) == (512, 128)
    assert args.e2e_backends == ["triton", "triton-eager", "torch", "triton+fp8"]
    assert args.e2e_concurrency == [1, 8]
    assert args.profiling_quantizations == ["auto", "fp8"]
    assert args.e2e_dtypes == ["float32", "bfloat16"]
    assert check.parse_args(["--concurrency", "2,8", "--e2e-backends", "torch"]).e2e_backends == ["torch"]


def test_toy_overrides_every_size():
    args = check.parse_args(["--toy", "--concurrency", "64", "--decode-batch", "64"])
    assert args.concurrency == [2] and args.decode_batch == 2 and args.kv_cache_memory == "16MiB"
    assert args.attention_cases is kernel_checks.TOY_ATTENTION_CASES and len(args.tolerance) == 2


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("NVIDIA H200", 4800),
        ("NVIDIA H100 80GB HBM3", 3350),
        ("NVIDIA H100 PCIe", 2000),
        ("NVIDIA A100-SXM4-80GB", 2039),
        ("NVIDIA A100-SXM4-40GB", 1555),
        ("NVIDIA L4", 300),
        ("Some Future GPU", None),
    ],
)
def test_peak_bandwidth_by_device_name(name, expected):
    assert check.peak_gbps(name) == expected


def test_peak_override_wins():
    assert check.peak_gbps("NVIDIA H200", 4000.0) == 4000.0
    assert check.peak_gbps("Some Future GPU", 1234.0) == 1234.0


def test_decode_bytes_counts_kv_queries_outputs_and_tables():
    # 64 sequences x 2048 positions x 8 KV heads x 128 dims x 2 bytes, for K and for V
    kv = 2 * 64 * 2048 * 8 * 128 * 2
    q_and_out = 2 * 64 * 32 * 128 * 2
    tables = 64 * 128 * 4  # 128 blocks of 16 a sequence, int32
    assert check.decode_bytes(64, 2048, 32, 8, 128, 2, 16) == kv + q_and_out + tables


def test_bandwidth_is_bytes_over_time_as_share_of_peak():
    result = check.bandwidth(2_400_000_000, 0.001, 4800)  # 2.4 GB in a millisecond = 2.4 TB/s
    assert result == {"achieved_gbps": 2400.0, "share_of_peak": 0.5}
    assert check.bandwidth(1_000_000, 0.001, None)["share_of_peak"] is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_refuses_clearly_without_cuda(capsys):
    assert check.main(["--section", "kernels"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_kernel_sections_at_toy_sizes(tmp_path):
    """The kernels agree with their twins, decode attention is timed in each variant, and without a model the
    engine rows say so; each section's file holds its own rows."""
    device = "cpu" if INTERPRETING else "cuda"
    kernels, figures = tmp_path / "kernels.json", tmp_path / "figures.json"
    assert check.main(["--section", "kernels", "--toy", "--device", device, "--out", str(kernels)]) == 0
    argv = ["--section", "figures", "--toy", "--device", device, "--no-model", "--out", str(figures)]
    assert check.main(argv) == 0
    report = json.loads(kernels.read_text())
    assert len(report["correctness"]) == 2 * 6 + len(kernel_checks.TOY_FP8_CASES)
    assert all(case["ok"] for case in report["correctness"])
    assert "decode_attention" not in report and report["seconds"] > 0
    report = json.loads(figures.read_text())
    variants = {row["variant"] for row in report["decode_attention"]}
    assert variants == {
        "triton",
        "triton-no-split",
        "torch-paged",
        "sdpa-contiguous-cache",
        "sdpa-gather-then-attend",
    }
    assert all(row["max_error_vs_sdpa"] < 3e-2 for row in report["decode_attention"])
    assert report["throughput"] == [{"skipped": "no model"}]
    markdown = render(report)
    assert markdown.count("| toy |") == 5 and "- engine: skipped (no model)" in markdown


def test_rows_reach_the_file_as_they_come_and_a_failing_section_keeps_them(tmp_path, monkeypatch):
    out = tmp_path / "kernels.json"
    seen_in_file = []

    def two_rows_then_fault(key, args, peak, clock):
        for i in range(2):
            seen_in_file.append(len(json.loads(out.read_text())[key]))
            yield {"kernel": f"k{i}", "dtype": "float32", "max_error": 0.0, "ok": True}
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(check, "section_rows", two_rows_then_fault)
    monkeypatch.setattr(check, "device_problem", lambda device: None)
    assert check.main(["--section", "kernels", "--device", "cpu", "--out", str(out)]) == 1
    assert seen_in_file == [0, 1]  # each row was in the file before the next was made
    report = json.loads(out.read_text())
    assert [row["kernel"] for row in report["correctness"]] == ["k0", "k1"]
    assert "illegal memory access" in report["errors"]["correctness"]["error"]
    assert not list(tmp_path.glob("*.partial"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--e2e-backends", "triton-fast"], "--e2e-backends: 'triton-fast' is not auto, torch or triton"),
        (["--throughput-backends", "torch-graphs"], "--throughput-backends: 'torch-graphs'"),
        (
            ["--throughput-backends", "triton+q4"],
            "'triton+q4': +q4 is not a quantization (auto, none, int8, fp8)",
        ),
        (
            ["--profiling-quantizations", "auto,fp4"],
            "--profiling-quantizations: fp4 not in auto, none, int8, fp8",
        ),
    ],
)
def test_unknown_e2e_backend_is_refused(capsys, argv, message):
    with pytest.raises(SystemExit):
        check.parse_args(argv)
    assert message in capsys.readouterr().err
