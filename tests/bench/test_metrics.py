import random

import numpy as np
import pytest

from bench.metrics import RequestResult, percentile, summarize


def test_percentile_interpolates_like_numpy():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(1, 11)), 90) == pytest.approx(9.1)
    assert percentile([7.0], 99) == 7.0
    rng = random.Random(0)
    values = [rng.random() for _ in range(101)]
    for p in (50, 90, 99):
        assert percentile(values, p) == pytest.approx(np.percentile(values, p))


def test_request_ttft_itl_tpot():
    r = RequestResult(0, e2e=0.35, chunk_times=[0.1, 0.15, 0.3], output_tokens=3)
    assert r.ttft == 0.1
    assert r.itl == pytest.approx([0.05, 0.15])
    assert r.tpot == pytest.approx((0.35 - 0.1) / 2)


def test_tpot_undefined_for_one_token_or_no_content():
    assert RequestResult(0, e2e=0.2, chunk_times=[0.1], output_tokens=1).tpot is None
    assert RequestResult(0, e2e=0.2, output_tokens=0).tpot is None


def test_summary_pools_itl_and_leaves_out_failures():
    one_gap = RequestResult(
        0, e2e=0.03, chunk_times=[0.02, 0.03], output_tokens=2, prompt_tokens=100, cached_tokens=50
    )
    three_gaps = RequestResult(
        1,
        e2e=0.2,
        chunk_times=[0.1, 0.13, 0.16, 0.19],
        output_tokens=4,
        prompt_tokens=100,
        cached_tokens=None,
    )
    failed = RequestResult(2, e2e=5.0, chunk_times=[4.0, 4.5], output_tokens=2, error="HTTP 400: bad")
    s = summarize([one_gap, three_gaps, failed], duration=2.0)

    # pooled: (10 + 30 + 30 + 30) / 4 = 25 ms, not the mean of per-request means (20 ms)
    assert s["itl_ms"]["mean"] == pytest.approx(25.0)
    assert s["itl_ms"]["p50"] == pytest.approx(30.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(60.0)
    assert s["tpot_ms"]["mean"] == pytest.approx((10.0 + 100 / 3) / 2)
    assert s["e2e_ms"]["p99"] < 1000  # the failed request's 5 s is not in it
    assert (s["completed"], s["failed"], s["output_tokens"]) == (2, 1, 6)
    assert s["output_tokens_per_s"] == pytest.approx(3.0)
    assert s["requests_per_s"] == pytest.approx(1.0)
    # only requests that report cached_tokens count towards the share
    assert s["cached_token_share"] == pytest.approx(0.5)
    assert s["errors"] == {"count": 1, "messages": ["HTTP 400: bad"]}
    assert s["executors"] == {}


def test_summary_without_cache_reports_or_results():
    s = summarize([RequestResult(0, e2e=0.1, chunk_times=[0.1], output_tokens=1, prompt_tokens=5)], 1.0)
    assert s["cached_token_share"] is None and s["cached_tokens"] is None
    assert s["tpot_ms"]["mean"] is None
    empty = summarize([], 1.0)
    assert empty["ttft_ms"] == {"mean": None, "p50": None, "p90": None, "p99": None}
