"""bench/gpu/e2e.py: a backend that fails does not stop the next, no engine is started that the deadline has no room
for, the profiled start is reported as needing CUDA elsewhere, and the engine's log lines are caught. The
sections run whole, in Triton's interpreter, in session.sh's dry run (test_session)."""

from __future__ import annotations

import time

import pytest

from bench.gpu import check, e2e
from executor import CompletionOutput
from executor.sampling.sampler import TokenLogprobs


def toy_args(model: str, *extra: str):
    return check.parse_args(["--device", "cpu", "--toy", "--model", model, *extra])


def test_a_failing_backend_is_reported_and_the_next_still_runs(tiny_models, monkeypatch):
    args = toy_args(tiny_models["llama"], "--e2e-backends", "torch,triton")
    serve = e2e._serve
    monkeypatch.setattr(
        e2e,
        "_serve",
        lambda args, backend, *rest: serve(args, backend, *rest) if backend == "torch" else 1 / 0,
    )
    rows = list(e2e.agreement(args, e2e.EngineClock(float("inf"))))
    assert rows[0]["backend"] == "torch" and rows[0]["output_tokens"] == 2 * 3
    assert rows[0]["tokens_matching_first_backend"] == 1.0 and rows[0]["cuda_graphs"] is False
    assert rows[0]["sequences_parted"] == 0 and rows[0]["widest_parting_nats"] is None
    assert rows[1]["backend"] == "triton" and "ZeroDivisionError" in rows[1]["error"]


def test_no_engine_starts_that_the_deadline_has_no_room_for(monkeypatch):
    def build(self, *args, **kwargs):
        raise AssertionError("an engine was started past its room")

    monkeypatch.setattr(e2e.EngineClock, "build", build)
    args = toy_args("unused")
    clock = e2e.EngineClock(time.perf_counter() + e2e.ENGINE_START_GUESS_S / 2)
    rows = list(e2e.throughput(args, clock))  # the first build's guess is the constant
    assert rows == [
        {"backend": b, "skipped": "time budget spent"} for b in ("triton", "triton-eager", "triton+fp8")
    ]
    assert list(e2e.adapter_throughput(args, clock)) == [
        {"backend": "triton", "skipped": "time budget spent"}
    ]
    clock.last_build_s = 0.1  # after a build, its own time
    assert clock.has_room()


def test_profiled_start_needs_cuda():
    rows = list(e2e.profiled_start(toy_args("unused"), e2e.EngineClock(float("inf"))))
    assert rows == [{"skipped": "needs CUDA"}]


def test_the_engine_log_lines_are_caught_whatever_logging_is_set_to(tiny_models):
    with e2e._engine_log_lines() as lines:
        e2e.EngineClock(float("inf")).build(tiny_models["llama"], device="cpu", kv_cache_memory="8MiB")
    assert any(line.startswith("KV cache: ") for line in lines)


def _run(tokens: list[int], top: list[list[tuple[int, float]]] | None = None):
    logprobs = (
        None
        if top is None
        else [TokenLogprobs(t, row[0][1], 1, row) for t, row in zip(tokens, top, strict=True)]
    )
    return CompletionOutput(0, "", tokens, logprobs=logprobs)


def test_sequences_that_part_are_judged_by_the_first_ones_margin_where_they_part():
    first = _run([5, 6, 7], [[(5, -0.1), (9, -3.0)], [(6, -0.690), (8, -0.695)], [(7, -0.2), (1, -2.0)]])
    assert e2e.parting_margin(first, _run([5, 6, 7])) is None
    assert e2e.parting_margin(first, _run([5, 8, 2])) == pytest.approx(0.005)  # a near tie at the 2nd
    assert e2e.parting_margin(first, _run([9, 6, 7])) == pytest.approx(2.9)
    assert e2e.parting_margin(first, _run([5, 4, 7])) == float("inf")  # not even the first's runner-up
    assert 0.005 <= e2e.NEAR_TIE_NATS < 2.9


def test_a_backend_names_its_quantization():
    assert e2e.split_backend("triton") == ("triton", False, "auto")
    assert e2e.split_backend("triton-eager+fp8") == ("triton", True, "fp8")


@pytest.mark.parametrize("backend", ["triton-fast", "eager"])
def test_split_backend_refuses_unknown_names(backend):
    with pytest.raises(ValueError, match="is not auto, torch or triton"):
        e2e.split_backend(backend)
