"""bench/faults/executor_kill.py's judgement: which failures a kill -9 allows, and what became of each request the
killed executor had in flight, as the gateway's log names them."""

from __future__ import annotations

from bench.faults.executor_kill import lost_on, report

VICTIM = "executor-0"
MID_STREAM = f"stream error: executor {VICTIM} stopped answering mid-stream"
TIMES = {"killed_at_s": 8.0, "health_dropped_s": 0.3, "health_back_s": 9.0, "serving_again_s": 10.0}


def gateway_log(lost: dict[str, str]) -> str:
    """`kvserve up`'s log (text format) around a kill: request id -> the executor that stopped answering it."""
    lines = [f"2026-12-01 15:00:59,836 ERROR kvserve.up: {VICTIM} died (pid 6802, killed by SIGKILL)"]
    for request_id, executor in lost.items():
        prefix = f"2026-12-01 15:01:00,391 WARNING kvserve.gateway request_id={request_id}:"
        lines.append(f"{prefix} executor {executor} stopped answering (request {request_id})")
        lines.append(f"{prefix} request failed (502): executor {executor} stopped answering mid-stream")
    return "\n".join(lines) + "\n"


def stream(request_id: str, executor: str, ttft: float | None, error: str | None = None) -> dict:
    return {"request_id": request_id, "executor": executor, "ttft_s": ttft, "error": error}


def whole(request_id: str, executor: str | None, status: int | None, error: str | None = None) -> dict:
    return {"request_id": request_id, "executor": executor, "status": status, "error": error, "sent": 7.0}


def judge(tmp_path, lost: dict[str, str], streams: list[dict], wholes: list[dict], **times) -> dict:
    log = tmp_path / "up.log"
    log.write_text(gateway_log(lost))
    killed = {"executor": VICTIM, **TIMES, **times, "whole": wholes}
    return report(killed, {"requests": streams}, lost_on(log, VICTIM))[0]["summary"]


def test_only_the_victims_streams_that_had_tokens_may_fail(tmp_path):
    streams = [
        stream("s1", VICTIM, 1.2, MID_STREAM),  # had tokens from the killed executor: allowed
        stream("s2", VICTIM, 9.5),  # queued there, moved, completed elsewhere
        stream("s3", "executor-1", 0.8),
    ]
    lost = {"s1": VICTIM, "s2": VICTIM, "w1": VICTIM, "x9": "executor-1"}
    summary = judge(tmp_path, lost, streams, [whole("w1", "executor-1", 200), whole("x9", "executor-1", 200)])
    assert summary["in_flight_on_killed"] == 3  # the victim's: not x9, lost on another executor
    assert (summary["in_flight_completed_elsewhere"], summary["in_flight_mid_stream_errors"]) == (2, 1)
    assert summary["stream_errors_mid_stream_on_killed"] == 1
    assert summary["stream_errors_other"] == summary["in_flight_other_errors"] == summary["whole_errors"] == 0
    assert summary["target_met"]


def test_any_other_failure_misses_the_target(tmp_path):
    cases = [
        # a stream that had no token yet must have moved, not failed
        ({"s2": VICTIM}, [stream("s2", VICTIM, None, MID_STREAM)], []),
        # a stream on the survivor
        ({}, [stream("s3", "executor-1", 0.5, "HTTP 503: every executor is busy")], []),
        # a non-streaming request, however it failed
        ({"w1": VICTIM}, [], [whole("w1", VICTIM, 502, "executor stopped answering")]),
        ({}, [], [whole("w2", None, None, "ReadTimeout")]),
        # one the gateway lost on the victim that neither load saw end
        ({"w3": VICTIM}, [], []),
    ]
    for lost, streams, wholes in cases:
        assert judge(tmp_path, lost, streams, wholes, serving_again_s=10.0)["target_met"] is False, lost
        # the same loads with every request fine
        fine = [{**r, "error": None, "ttft_s": 1.0} for r in streams]
        fine_wholes = [{**r, "status": 200, "error": None, "executor": "executor-1"} for r in wholes]
        assert judge(tmp_path, {k: v for k, v in lost.items() if k != "w3"}, fine, fine_wholes)["target_met"]
    # an executor never at work again misses it too
    assert judge(tmp_path, {}, [], [], serving_again_s=None)["target_met"] is False
