"""The noisy-neighbour benchmark's arithmetic: cached shares per prefix, percentiles, the table."""

import pytest

from bench.metrics import RequestResult
from bench.tenancy.noisy_neighbour import Phase, cached_share, markdown_table, summarise


def _result(ttft: float, prompt: int, cached: int, error: str | None = None) -> RequestResult:
    return RequestResult(
        0, chunk_times=[ttft, ttft + 0.1, ttft + 0.3], prompt_tokens=prompt, cached_tokens=cached, error=error
    )


def test_cached_share_counts_completed_requests_only():
    assert (
        cached_share([_result(0.1, 100, 90), _result(0.1, 100, 0), _result(0.1, 100, 100, "HTTP 503")])
        == 0.45
    )
    assert cached_share([]) is None


def test_summary_pools_both_prefixes_and_counts_each_sides_errors():
    phase = Phase(
        a=[_result(0.1, 800, 784), _result(0.3, 800, 784)],
        b=[_result(2.0, 800, 0), _result(0.1, 800, 0, "stream error: x")],
        aggressor=[{"ttft": 5.0, "error": None}, {"ttft": None, "error": "HTTP 503: busy"}],
    )
    summary = summarise(phase)
    assert summary["victim_requests"] == 4 and summary["victim_errors"] == 1
    assert summary["victim_ttft_p50"] == 0.3  # of the three that completed
    assert summary["victim_itl_p50"] == pytest.approx(0.15) and summary["victim_itl_p90"] == pytest.approx(
        0.2
    )
    assert summary["cached_share_a"] == 0.98 and summary["cached_share_b"] == 0.0
    assert (summary["aggressor_errors"], summary["aggressor_ttft_p90"]) == (1, 5.0)
    table = markdown_table({"modes": {"on": {"flood": summary}}})
    assert "| on | flood | 0.30 s /" in table and "| 1, 1 |" in table
