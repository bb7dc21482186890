"""An executor killed with SIGKILL under load, beside `kvserve bench`'s streaming load (executor_kill.sh beside it).

While the streams run, this sends a closed loop of non-streaming requests, kills one executor of `kvserve up`
(found among its children by --executor-id) --kill-after seconds after the streams arrived (--streams), once
it runs --min-running requests, and watches /health for the executor to go and come back. When the streaming
run's --output JSON is there, it classifies every request: a stream that had received tokens from the killed
executor and ended "stopped answering mid-stream" is the one failure allowed; any other failure, streaming or
not, is not. The requests the killed executor had in flight are the ones the gateway logged it "stopped
answering" (--gateway-log), found by their x-request-id: each must have completed elsewhere or be such a
stream. Also reported: when /health listed the executor again, when its published stats showed it at work
again, and when a non-streaming request sent after the kill was first answered by it.

    python -m bench.faults.executor_kill --url http://127.0.0.1:8350 --up-pid PID --stream-results run.json \\
        --output bench/results/executor-kill

Target (issue 13): every request the killed executor had not started completes elsewhere; `kvserve up` has it
back. Exit 0 when met.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.faults.fuzz import executor_load
from bench.stream import EXECUTOR_HEADER, REQUEST_ID_HEADER

MID_STREAM = "stopped answering mid-stream"


@dataclass(slots=True)
class WholeResult:
    """One non-streaming request; times in seconds since this run began."""

    sent: float
    ended: float
    status: int | None  # None: no HTTP answer at all
    executor: str | None
    request_id: str | None  # the gateway's, as its log lines name it
    error: str | None


def executor_pid(up_pid: int, executor_id: str) -> int:
    """The child of `kvserve up` started with --executor-id executor_id."""
    children = subprocess.run(["pgrep", "-P", str(up_pid)], capture_output=True, text=True).stdout.split()
    for pid in map(int, children):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"--executor-id" in argv and argv[argv.index(b"--executor-id") + 1].decode() == executor_id:
            return pid
    raise LookupError(f"no child of {up_pid} runs --executor-id {executor_id}")


async def whole_load(
    client: httpx.AsyncClient, model: str, concurrency: int, max_tokens: int, until: float, start: float
) -> list[WholeResult]:
    """Closed loop of non-streaming completions, each with a prompt of its own (so routing spreads them)."""
    results: list[WholeResult] = []
    count = 0

    async def worker() -> None:
        nonlocal count
        while time.monotonic() < until:
            count += 1
            body = {
                "model": model,
                "prompt": f"Request {count}: tell me about robots.",
                "max_tokens": max_tokens,
            }
            sent = time.monotonic() - start
            status = executor = request_id = error = None
            try:
                response = await client.post("/v1/completions", json={**body, "ignore_eos": True})
                status, executor = response.status_code, response.headers.get(EXECUTOR_HEADER)
                request_id = response.headers.get(REQUEST_ID_HEADER)
                if status != 200:
                    error = response.text[:300]
            except httpx.HTTPError as caught:
                error = f"{type(caught).__name__}: {caught}"
            ended = time.monotonic() - start
            results.append(WholeResult(sent, ended, status, executor, request_id, error))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def routed(metrics_text: str) -> float:
    """How many routing decisions the gateway has made: requests that reached it, whoever sent them."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(metrics_text)
        for sample in family.samples
        if sample.name == "kvserve_route_decisions_total"
    )


async def streams_under_way(client: httpx.AsyncClient, streams: int, timeout: float) -> None:
    """Returns once the gateway has routed `streams` requests (before this run sends any): `kvserve bench`
    takes seconds to start, and a kill before its streams arrive would test no stream."""
    deadline = time.monotonic() + timeout
    while routed((await client.get("/metrics")).text) < streams and time.monotonic() < deadline:
        await asyncio.sleep(0.1)


async def victim_busy(client: httpx.AsyncClient, victim: str, running: int, timeout: float) -> None:
    """Returns once the victim's published load shows `running` requests (or after timeout): a kill of an idle
    executor would test nothing."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        load = executor_load((await client.get("/metrics")).text).get(victim, {})
        if load.get("running_requests", 0) >= running:
            return
        await asyncio.sleep(0.1)


def lost_on(gateway_log: Path, victim: str) -> set[str]:
    """Ids of the requests the gateway saw the victim stop answering: those it had in flight when killed."""
    marker = f"executor {victim} stopped answering (request "
    return {
        line.split(marker, 1)[1].split(")", 1)[0]
        for line in gateway_log.read_text(errors="replace").splitlines()
        if marker in line
    }


def started_work(metrics_text: str, executor_id: str) -> bool:
    """Whether the executor's published stats show it running a request or having admitted one since it
    started (its counters begin at 0 with each start)."""
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.labels.get("executor") != executor_id or not sample.value:
                continue
            if (
                sample.name == "kvserve_running_requests"
                or family.name == "kvserve_prefix_cache_queried_tokens"
            ):
                return True
    return False


async def watch_health(
    client: httpx.AsyncClient, victim: str, killed: asyncio.Event, until: float, start: float
) -> tuple[float | None, float | None, float | None]:
    """Seconds when /health first left the victim out after the kill, when it listed it again, and when its
    stats first showed it at work again."""
    gone = back = serving = None
    while time.monotonic() < until and serving is None:
        try:
            if back is None:
                listed = victim in (await client.get("/health")).json().get("executors", [])
            else:
                serving = (
                    time.monotonic() - start
                    if started_work((await client.get("/metrics")).text, victim)
                    else None
                )
        except (httpx.HTTPError, ValueError):
            listed = False
        now = time.monotonic() - start
        if killed.is_set() and back is None:
            if not listed and gone is None:
                gone = now
            elif listed and gone is not None:
                back = now
        await asyncio.sleep(0.1)
    return gone, back, serving


def outcome(request: dict, victim: str, ok: bool) -> str:
    """'ok', 'mid_stream_on_killed' (the one failure allowed) or 'failed'."""
    if ok:
        return "ok"
    error = request["error"] or ""
    had_tokens = request.get("ttft_s") is not None  # a stream's; a whole request shows the client nothing
    return (
        "mid_stream_on_killed"
        if request["executor"] == victim and had_tokens and MID_STREAM in error
        else "failed"
    )


async def run(args: argparse.Namespace) -> dict:
    killed = asyncio.Event()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.url, timeout=args.timeout, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await streams_under_way(client, args.streams, timeout=60)
        start = time.monotonic()
        until = start + args.duration

        async def kill() -> float:
            await asyncio.sleep(args.kill_after)
            await victim_busy(client, args.executor_id, args.min_running, timeout=30)
            os.kill(executor_pid(args.up_pid, args.executor_id), signal.SIGKILL)
            killed.set()
            return time.monotonic() - start

        load = whole_load(client, model, args.concurrency, args.max_tokens, until, start)
        killed_at, (gone, back, serving), whole = await asyncio.gather(
            kill(), watch_health(client, args.executor_id, killed, until, start), load
        )
    served_again = [
        r.ended for r in whole if r.executor == args.executor_id and r.status == 200 and r.sent > killed_at
    ]
    return {
        "executor": args.executor_id,
        "killed_at_s": killed_at,
        "health_dropped_s": None if gone is None else gone - killed_at,
        "health_back_s": None if back is None else back - killed_at,
        "serving_again_s": None if serving is None else serving - killed_at,
        "whole_answered_by_it_again_s": min(served_again) - killed_at if served_again else None,
        "whole": [asdict(r) for r in whole],
    }


def wait_for(path: Path, timeout: float) -> dict:
    """The streaming run's report, once `kvserve bench` has written it whole."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            time.sleep(1)
    raise TimeoutError(f"{path} not written in {timeout} s")


def report(killed: dict, streams: dict, lost: set[str]) -> tuple[dict, str]:
    """Every request's outcome, and what became of each one the killed executor had in flight."""
    victim = killed["executor"]
    requests = [("stream", r, outcome(r, victim, r["error"] is None)) for r in streams["requests"]]
    requests += [("whole", r, outcome(r, victim, r["status"] == 200)) for r in killed["whole"]]
    by_id = {r["request_id"]: (kind, r, result) for kind, r, result in requests if r["request_id"]}
    in_flight = [
        by_id.get(request_id, ("unseen", {"request_id": request_id}, "failed")) for request_id in lost
    ]

    def count(rows, kind: str | None, result: str) -> int:
        return sum((kind is None or k == kind) and res == result for k, _, res in rows)

    summary = {
        "executor": victim,
        "stream_requests": sum(k == "stream" for k, _, _ in requests),
        "stream_errors_mid_stream_on_killed": count(requests, "stream", "mid_stream_on_killed"),
        "stream_errors_other": count(requests, "stream", "failed"),
        "whole_requests": sum(k == "whole" for k, _, _ in requests),
        "whole_errors": sum(k == "whole" and res != "ok" for k, _, res in requests),
        "in_flight_on_killed": len(in_flight),
        # the executor is dead: whatever of it ended well ended elsewhere (a stream's header names the
        # executor first chosen, as its headers went out before the move)
        "in_flight_completed_elsewhere": count(in_flight, None, "ok"),
        "in_flight_mid_stream_errors": count(in_flight, None, "mid_stream_on_killed"),
        "in_flight_other_errors": count(in_flight, None, "failed"),
        **{k: v for k, v in killed.items() if k.endswith("_s")},
    }
    summary["target_met"] = (
        summary["stream_errors_other"] == 0
        and summary["whole_errors"] == 0
        and summary["in_flight_other_errors"] == 0
        and killed["serving_again_s"] is not None
    )
    lines = [f"{k}: {round(v, 2) if isinstance(v, float) else v}" for k, v in summary.items()]
    lines += [
        f"{kind} request {r['request_id']} failed: {r.get('status', '')} {r.get('error')} [executor {r.get('executor')}]"
        for kind, r, result in requests
        if result == "failed"
    ]
    details = {"summary": summary, "in_flight_on_killed": in_flight, "whole": killed["whole"]}
    return details, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.faults.executor_kill", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--url", required=True)
    parser.add_argument("--up-pid", type=int, required=True, help="the `kvserve up` whose executor is killed")
    parser.add_argument("--executor-id", default="executor-0")
    parser.add_argument("--kill-after", type=float, default=5.0, help="seconds into the load")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of non-streaming load")
    parser.add_argument("--streams", type=int, default=1, help="start once the gateway has routed this many")
    parser.add_argument("--min-running", type=int, default=2, help="kill once the victim runs this many")
    parser.add_argument("--concurrency", type=int, default=2, help="non-streaming clients")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--stream-results", type=Path, required=True, help="kvserve bench's --output")
    parser.add_argument(
        "--gateway-log", type=Path, required=True, help="`kvserve up`'s log (--log-format text)"
    )
    parser.add_argument("--output", type=Path, required=True, help="writes OUTPUT.json and OUTPUT.txt")
    args = parser.parse_args(argv)
    killed = asyncio.run(run(args))
    streams = wait_for(args.stream_results, timeout=args.timeout + 60)
    details, text = report(killed, streams, lost_on(args.gateway_log, args.executor_id))
    args.output.with_suffix(".json").write_text(json.dumps(details, indent=2))
    args.output.with_suffix(".txt").write_text(text + "\n")
    print(text)
    return 0 if details["summary"]["target_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
