"""The fuzz target against a running kvserve gateway: bench/faults/bad_requests.py's seeded bad requests over
both completion endpoints must each get a 4xx in OpenAI's error shape (or a whole 200 where the input turned
out valid), never a 5xx or a dropped connection; afterwards the executors must hold no KV blocks and a plain
request must be served.

    python -m bench.faults.fuzz --url http://127.0.0.1:8000 --requests 2000 [--seed 0] [--concurrency 8] \\
        [--metrics-url http://127.0.0.1:9100/metrics]

Exit status 0 only when all of that held. tests/gateway/test_bad_input_stack.py runs the same in CI, with fewer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.faults.bad_requests import FuzzRequest, bad_requests


@dataclass(slots=True)
class FuzzReport:
    statuses: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)  # every answer that broke the rules, and why
    seconds: float = 0.0


def problem(status: int, content_type: str, body: bytes) -> str | None:
    """What is wrong with one answer, or None: a 4xx must carry OpenAI's error object, a 200 a whole answer."""
    if status >= 500 or status < 200 or 200 < status < 400:
        return f"status {status}: {body[:200]!r}"
    if status == 200 and content_type.startswith("text/event-stream"):
        events = [block.removeprefix(b"data: ") for block in body.split(b"\n\n") if block]
        if not events or events[-1] != b"[DONE]":
            return f"stream did not end with [DONE]: {body[-200:]!r}"
        # a refusal that only the executor could make (a logit_bias token past its vocabulary) comes after the
        # stream started: it rides an error event, and must be the client's error, not ours
        faults = [e for e in events if e.startswith(b'{"error"') and b'"invalid_request_error"' not in e]
        return f"error event in a 200 stream: {faults[0][:200]!r}" if faults else None
    try:
        payload = json.loads(body)
    except ValueError:
        return f"status {status} with a body that is not JSON: {body[:200]!r}"
    if status == 200:
        return (
            None
            if isinstance(payload, dict) and payload.get("choices")
            else f"200 without choices: {body[:200]!r}"
        )
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict) or not {"message", "type", "param", "code"} <= set(error):
        return f"status {status} not in OpenAI's error shape: {body[:200]!r}"
    if not isinstance(error["message"], str) or not error["message"] or not isinstance(error["type"], str):
        return f"status {status} with an empty or mistyped message: {body[:200]!r}"
    return None


async def run(
    url: str, requests: list[FuzzRequest], concurrency: int = 8, timeout: float = 120
) -> FuzzReport:
    report = FuzzReport()
    pending = iter(requests)
    started = time.monotonic()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:

        async def worker() -> None:
            for request in pending:
                headers = {} if request.content_type is None else {"content-type": request.content_type}
                try:
                    response = await client.request(
                        request.method, request.path, content=request.body, headers=headers
                    )
                except httpx.HTTPError as error:
                    report.problems.append(f"{request.kind}: no answer ({error!r})")
                    continue
                report.statuses[response.status_code] += 1
                found = problem(
                    response.status_code, response.headers.get("content-type", ""), response.content
                )
                if found:
                    report.problems.append(f"{request.kind}: {found}")

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    report.seconds = time.monotonic() - started
    return report


def executor_load(metrics_text: str) -> dict[str, dict[str, float]]:
    """executor id -> {kv_blocks_used, running_requests, waiting_requests}, from one /metrics page."""
    wanted = {"kvserve_kv_blocks_used", "kvserve_running_requests", "kvserve_waiting_requests"}
    load: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in wanted:
                load.setdefault(sample.labels["executor"], {})[sample.name.removeprefix("kvserve_")] = (
                    sample.value
                )
    return load


def idle(load: dict[str, dict[str, float]]) -> bool:
    """Every executor seen and holding nothing: no block in use, nothing running or waiting."""
    return bool(load) and all(not any(values.values()) for values in load.values())


async def still_serves(url: str, model: str) -> bool:
    body = {"model": model, "prompt": "hello", "max_tokens": 2}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        response = await client.post("/v1/completions", json=body)
    return response.status_code == 200 and bool(response.json().get("choices"))


async def _settled_load(metrics_url: str, wait_s: float) -> dict[str, dict[str, float]]:
    """The executors' load once they have published it idle, or as it stands after wait_s."""
    deadline = time.monotonic() + wait_s
    async with httpx.AsyncClient(timeout=30) as client:
        while True:
            load = executor_load((await client.get(metrics_url)).text)
            if idle(load) or time.monotonic() > deadline:
                return load
            await asyncio.sleep(0.25)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.faults.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the gateway, e.g. http://127.0.0.1:8000")
    parser.add_argument("--metrics-url", default=None, help="default: URL/metrics")
    parser.add_argument("--model", default=None, help="default: the first of URL/v1/models")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args(argv)
    url = args.url.rstrip("/")
    model = args.model or httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    report = asyncio.run(run(url, bad_requests(args.seed, args.requests, model), args.concurrency))
    load = asyncio.run(_settled_load(args.metrics_url or f"{url}/metrics", 10))
    serves = asyncio.run(still_serves(url, model))
    fives = sum(n for status, n in report.statuses.items() if status >= 500)
    print(f"{args.requests} fuzzed requests (seed {args.seed}) in {report.seconds:.1f} s")
    print("statuses: " + ", ".join(f"{s} x {n}" for s, n in sorted(report.statuses.items())))
    print(f"5xx: {fives}; answers breaking the rules: {len(report.problems)}")
    for line in report.problems[:20]:
        print(f"  {line}")
    print(f"executors afterwards: {load}")
    print(f"a plain request afterwards: {'served' if serves else 'FAILED'}")
    return 0 if not report.problems and idle(load) and serves else 1


if __name__ == "__main__":
    sys.exit(main())
