"""bench/gpu/report_sections.py: the rows of output tok/s over LoRA adapters as a table beside base only, and an
adapters run that failed or was skipped named below it."""

from __future__ import annotations

from bench.gpu.report_sections import adapter_lines


def test_adapter_rows_are_a_table_with_their_share_of_base_only():
    row = {"backend": "triton", "concurrency": 16, "rank": 16, "seconds": 2.0}
    report = {
        "adapters": [
            row | {"adapters": 0, "cuda_graphs": True, "output_tok_s": 1000.0, "of_base": None},
            row | {"adapters": 8, "cuda_graphs": False, "output_tok_s": 800.0, "of_base": 0.8},
        ]
    }
    lines = adapter_lines(report)
    assert lines[2:] == [
        "| base only | 16 | yes | 1000.0 |  | 2.0 |",
        "| 8 of rank 16 | 16 | no | 800.0 | 0.8 | 2.0 |",
    ]
    failed = {"adapters": [{"backend": "triton", "error": "RuntimeError('x')"}], "errors": {}}
    assert adapter_lines(failed) == ["- triton failed: `RuntimeError('x')`"]
