"""bench/gpu/report.py: what it calls a failure, the notes a summary line gets, and the markdown of a session whose
stages did not all leave their files."""

from __future__ import annotations

import json

from bench.gpu import report

REPORT = {
    "device": "NVIDIA H200",
    "peak_gbps": 4800,
    "correctness": [
        {"kernel": "rms_norm", "dtype": "float16", "max_error": 1e-3, "ok": True},
        {"kernel": "paged_attention/x", "dtype": "float16", "max_error": 0.5, "ok": False},
        {"kernel": "rotary_embedding", "dtype": "float16", "error": "RuntimeError('no sm_90')", "ok": False},
    ],
    "decode_attention": [],
    "errors": {"decode_attention": {"error": "RuntimeError('out of memory')", "traceback": "..."}},
    "end_to_end": [
        {"backend": "triton", "error": "ValueError('capture')"},
        {
            "backend": "torch",
            "dtype": "float32",
            "judged": True,
            "cuda_graphs": False,
            "concurrency": 8,
            "output_tokens": 256,
            "tokens_matching_first_backend": 0.25,
            "sequences_parted": 3,
            "parted_at_near_ties": 1,
            "widest_parting_nats": 2.5,
        },
        {
            "backend": "triton+fp8",
            "quantization": "fp8",
            "dtype": "bfloat16",
            "judged": False,
            "cuda_graphs": True,
            "concurrency": 8,
            "output_tokens": 256,
            "tokens_matching_first_backend": 0.5,
            "sequences_parted": 8,
            "parted_at_near_ties": 0,
            "widest_parting_nats": float("inf"),
        },
    ],
    "profiling": [
        {
            "backend": "triton",
            "quantization": "fp8",
            "cuda_graphs": True,
            "engine_start_s": 9.5,
            "weight_bytes": 150 * 2**20,
            "kv_blocks": 1000,
            "block_size": 16,
            "profiling_log": "profiling: ...",
            "output_tokens": 256,
        }
    ],
    "throughput": [{"backend": "torch", "concurrency": 256, "skipped": "time budget spent"}],
}

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1" failures="2"
skipped="10" tests="40"><testcase classname="tests.kernels.test_x" name="test_a"><failure message="boom"/>
</testcase><testcase classname="tests.kernels.test_x" name="test_b"/></testsuite></testsuites>"""


def test_problems_name_failed_kernels_sections_backends_and_disagreement():
    assert report.problems(REPORT) == [
        "decode_attention raised RuntimeError('out of memory')",
        "2 of 3 kernel cases failed",
        "agreement: triton failed",
        "torch at 8: 2 of 8 sequences parted from the first backend's past a near tie (widest 2.5 nats)",
    ]
    assert report.notes(REPORT) == [
        "throughput: time budget spent",
        "profiling sized 1000 KV blocks (fp8)",
    ]


def test_markdown_names_failures_errors_and_skips():
    markdown = report.render(REPORT)
    assert (
        "1 of 3 cases within tolerance" in markdown
        and "failed: paged_attention/x float16: 5.00e-01" in markdown
    )
    assert "failed: rotary_embedding float16: `RuntimeError('no sm_90')`" in markdown
    assert "**decode_attention failed**: `RuntimeError('out of memory')`" in markdown
    assert (
        "- triton failed: `ValueError('capture')`" in markdown
        and "| torch | float32 | no | 8 | 256 | 25% | 3 (1) | 2.5 |" in markdown
    )
    assert "- torch at 256: skipped (time budget spent)" in markdown
    assert "| triton+fp8 | bfloat16 | yes | 8 | 256 | 50% |" in markdown  # reported, not judged
    assert (
        "Started without --kv-cache-memory (fp8) (triton, CUDA graphs on, 9.5 s): 150 MiB of weights"
        in markdown
    )


def test_stage_notes(tmp_path):
    (tmp_path / "tests.xml").write_text(JUNIT)
    assert report.stage_note("tests", tmp_path) == "2 failed, 1 errors"
    assert report.tests_note({"tests": 9, "failures": 3, "errors": 0, "skipped": 0}) == "3 failed"
    (tmp_path / "env.json").write_text(json.dumps({"import_failures": {"executor.llm": "Traceback ..."}}))
    assert report.stage_note("env", tmp_path) == "1 imports failed: executor.llm"
    (tmp_path / "e2e.json").write_text(
        json.dumps({"end_to_end": [], "profiling": [{"skipped": "needs CUDA"}]})
    )
    assert report.stage_note("e2e", tmp_path) == "profiling: needs CUDA"
    (tmp_path / "figures.json").write_text('{"decode_attention": [')  # cut short
    assert report.stage_note("figures", tmp_path).startswith("figures.json unreadable")
    assert report.stage_note("kernels", tmp_path) == "no kernels.json"
    assert report.stage_note("model", tmp_path) == ""
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    assert report.tests_note(counts) == "collected, none run"
    assert report.tests_note(counts | {"tests": 12, "skipped": 2}) == "10 passed, 2 skipped"


def test_a_session_renders_what_exists_and_names_what_does_not(tmp_path, capsys):
    (tmp_path / "summary.txt").write_text("stages: env ok, model ok, kernels ok, tests TIMEOUT\n")
    (tmp_path / "kernels.json").write_text(
        json.dumps({k: REPORT[k] for k in ("device", "peak_gbps", "correctness")})
    )
    (tmp_path / "tests.xml").write_text(JUNIT)
    assert report.main([str(tmp_path)]) == 0
    markdown = capsys.readouterr().out
    assert markdown.startswith("`stages: env ok, model ok, kernels ok, tests TIMEOUT`")
    assert "1 of 3 cases within tolerance" in markdown and "Greedy tokens" not in markdown
    assert (
        "2 failed, 1 errors (40 in all)" in markdown and "- failed: tests.kernels.test_x::test_a" in markdown
    )
    assert "Missing from this session: env (env.json), e2e (e2e.json), figures (figures.json)." in markdown
