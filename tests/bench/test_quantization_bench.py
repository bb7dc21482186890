"""bench/quantization.py's combining of alternating rounds: the median round, every round's rate, and kvserve's
ratio to llama-server round by round."""

from __future__ import annotations

from bench.quantization import markdown, median_rates


def _round(rate: float, failed: int = 0) -> dict:
    return {
        "1": {"output_tok_s": rate, "tpot_p50_ms": 1000 / rate, "completed": 4 - failed, "failed": failed}
    }


def test_the_median_round_is_reported_with_every_rounds_rate_and_counts() -> None:
    merged = median_rates([_round(100.0), _round(140.0, failed=1), _round(120.0)])["1"]
    assert merged["output_tok_s"] == 120.0
    assert merged["tpot_p50_ms"] == 1000 / 120.0  # the same round's
    assert merged["rounds"] == [100.0, 140.0, 120.0]
    assert (merged["completed"], merged["failed"]) == (11, 1)


def test_the_table_shows_kvserves_ratio_to_llama_server_where_it_was_paired() -> None:
    kv = median_rates([_round(120.0), _round(110.0), _round(130.0)])
    kv["1"]["vs_llama_server"] = 1.25
    rows = [
        {"system": "kvserve q4_1", "weight_mib": 94.0, "streams": kv},
        {"system": "kvserve float32", "weight_mib": 621.0, "streams": median_rates([_round(45.0)])},
        {"system": "llama-server q4_1", "weight_mib": 94.0, "streams": {}},
    ]
    table = markdown(rows, [1], 128)
    assert "| kvserve q4_1 | 120.0 (1.25x llama-server) | 94 |" in table
    assert "| kvserve float32 | 45.0 | 621 |" in table
    assert "| llama-server q4_1 | — | 94 |" in table
