"""bench/gpu_check: its arithmetic and arguments, its refusal where it cannot run, and the whole script at toy
sizes (in Triton's interpreter on CPU where no CUDA device exists, on the GPU otherwise)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kernels.triton_mode import interpret_on_cpu_only_machines

INTERPRETING = interpret_on_cpu_only_machines(torch.cuda.is_available())

from bench import gpu_check, gpu_report  # noqa: E402


def test_help_runs_without_a_gpu():
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "--peak-gbps" in done.stdout


def test_defaults_are_the_issues_workload():
    args = gpu_check.parse_args([])
    assert (args.decode_batch, args.decode_context) == (64, 2048)
    assert args.concurrency == [1, 16, 64, 256]
    assert (args.prompt_len, args.output_len) == (512, 128)
    assert args.e2e_backends == ["triton", "triton-eager", "torch"]
    assert gpu_check.parse_args(["--concurrency", "2,8", "--e2e-backends", "torch"]).e2e_backends == ["torch"]


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
    assert gpu_check.peak_gbps(name) == expected


def test_peak_override_wins():
    assert gpu_check.peak_gbps("NVIDIA H200", 4000.0) == 4000.0
    assert gpu_check.peak_gbps("Some Future GPU", 1234.0) == 1234.0


def test_decode_bytes_counts_kv_queries_outputs_and_tables():
    # 64 sequences x 2048 positions x 8 KV heads x 128 dims x 2 bytes, for K and for V
    kv = 2 * 64 * 2048 * 8 * 128 * 2
    q_and_out = 2 * 64 * 32 * 128 * 2
    tables = 64 * 128 * 4  # 128 blocks of 16 a sequence, int32
    assert gpu_check.decode_bytes(64, 2048, 32, 8, 128, 2, 16) == kv + q_and_out + tables


def test_bandwidth_is_bytes_over_time_as_share_of_peak():
    result = gpu_check.bandwidth(2_400_000_000, 0.001, 4800)  # 2.4 GB in a millisecond = 2.4 TB/s
    assert result == {"achieved_gbps": 2400.0, "share_of_peak": 0.5}
    assert gpu_check.bandwidth(1_000_000, 0.001, None)["share_of_peak"] is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_refuses_clearly_without_cuda(capsys):
    assert gpu_check.main(["--skip-e2e"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_whole_script_at_toy_sizes(tiny_models, monkeypatch, tmp_path):
    """Every section runs and reports; the kernels agree with their twins."""
    monkeypatch.setattr(gpu_check, "ATTENTION_CASES", {"mixed": ([1, 7, 1], [40, 7, 17], 4, 2, 64, 16, None)})
    monkeypatch.setattr(gpu_check, "TOLERANCE", {torch.float32: 2e-5, torch.bfloat16: 3e-2})
    monkeypatch.setattr(gpu_check, "DECODE_SHAPES", {"toy": (4, 2, 64)})
    device = "cpu" if INTERPRETING else "cuda"
    out = tmp_path / "gpu_check.json"
    argv = ["--device", device, "--model", tiny_models["llama"], "--out", str(out), "--iters", "1"]
    argv += ["--decode-batch", "2", "--decode-context", "40", "--concurrency", "1,2", "--prompt-len", "8"]
    argv += ["--output-len", "3", "--kv-cache-memory", "16MiB"]
    assert gpu_check.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["all_correct"] and len(report["correctness"]) == 2 * 5
    variants = {row["variant"] for row in report["decode_attention"]}
    assert variants == {
        "triton",
        "triton-no-split",
        "torch-paged",
        "sdpa-contiguous-cache",
        "sdpa-gather-then-attend",
    }
    assert all(row["max_error_vs_sdpa"] < 3e-2 for row in report["decode_attention"])
    runs = [(row["backend"], row["concurrency"], row["output_tokens"]) for row in report["end_to_end"]]
    backends = ("triton", "triton-eager", "torch")
    assert runs == [(backend, n, 3 * n) for backend in backends for n in (1, 2)]
    assert all(row["tokens_matching_first_backend"] == 1.0 for row in report["end_to_end"])
    assert [row["cuda_graphs"] for row in report["end_to_end"]] == [device == "cuda"] * 2 + [False] * 4
    markdown = gpu_report.render(report)
    assert "10 of 10 cases within tolerance" in markdown
    assert markdown.count("| toy |") == 5 and markdown.count("| triton-eager | no |") == 2


def test_report_names_failures_errors_and_skips():
    report = {
        "device": "NVIDIA H200",
        "peak_gbps": 4800,
        "correctness": [
            {"kernel": "rms_norm", "dtype": "float16", "max_error": 1e-3, "ok": True},
            {"kernel": "paged_attention/x", "dtype": "float16", "max_error": 0.5, "ok": False},
        ],
        "decode_attention": {"error": "RuntimeError('out of memory')"},
        "end_to_end": [
            {"backend": "triton", "error": "ValueError('capture')"},
            {"backend": "torch", "concurrency": 256, "skipped": "time budget spent"},
        ],
    }
    markdown = gpu_report.render(report)
    assert "1 of 2 cases within tolerance" in markdown and "failed: paged_attention/x float16" in markdown
    assert "**decode_attention failed**: `RuntimeError('out of memory')`" in markdown
    assert "triton failed: `ValueError('capture')`" in markdown and "torch at 256: skipped" in markdown


def test_a_failing_backend_is_reported_and_the_next_still_runs(tiny_models, monkeypatch):
    args = gpu_check.parse_args(["--device", "cpu", "--model", tiny_models["llama"], "--concurrency", "1"])
    args.prompt_len, args.output_len, args.kv_cache_memory = 8, 2, "16MiB"
    args.e2e_backends = ["torch", "triton"]
    serve = gpu_check._serve
    monkeypatch.setattr(
        gpu_check,
        "_serve",
        lambda args, backend, *rest: serve(args, backend, *rest) if backend == "torch" else 1 / 0,
    )
    rows = gpu_check.end_to_end(args, deadline=float("inf"))
    assert rows[0]["backend"] == "torch" and rows[0]["output_tokens"] == 2
    assert rows[1]["backend"] == "triton" and "ZeroDivisionError" in rows[1]["error"]


def test_unknown_e2e_backend_is_refused(capsys):
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--e2e-backends", "triton-fast"])
    assert "'triton-fast' is not auto, torch or triton" in capsys.readouterr().err
