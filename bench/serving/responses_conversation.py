"""A conversation by previous_response_id on two executors: each turn's prompt is the last turn's whole prompt, its
answer and a new question, so routing by cached blocks sends it where that prefix is and only the new tokens are
prefilled (cached_tokens near the previous prompt's length).

A `kvserve up` with --executors 2 and one API key (bench/tenancy/tenant_stack.py); each turn streams
/v1/responses and records the executor that served it, the prompt's tokens, the cached ones and the time to
the first text delta.

python -m bench.serving.responses_conversation [--turns 10] [--max-output-tokens 32] [--model PATH] [--up-args "..."]
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from pathlib import Path

import httpx

from bench.tenancy.tenant_stack import tenant_stack

TOPICS = [
    "the history of the printing press",
    "how bees find flowers",
    "why the sky is blue",
    "the rules of chess",
    "how bread rises",
    "the water cycle",
    "how a bicycle stays upright",
    "what makes music sound sad",
    "how tides work",
    "why cats purr",
    "how volcanoes form",
    "the life of a star",
]
INSTRUCTIONS = "You are a patient teacher. Answer in two or three plain sentences."


def question(turn: int) -> str:
    """A question of about sixty tokens, different each turn."""
    topic = TOPICS[turn % len(TOPICS)]
    return (
        f"Question {turn + 1}: tell me about {topic}. Please keep in mind what we discussed before, relate it to "
        f"the earlier topics if you can, and give one concrete example that a curious twelve-year-old would "
        f"remember. Avoid jargon and keep it short."
    )


def wait_for_executors(url: str, count: int, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = httpx.get(f"{url}/health", timeout=10).json()
        if len(health.get("executors", [])) >= count:
            return
        time.sleep(1)
    raise RuntimeError(f"fewer than {count} executors registered within {timeout_s:.0f} s")


def turn(url: str, key: str, body: dict) -> dict:
    """One streamed turn: its executor, time to first text delta, and the final Response."""
    headers = {"authorization": f"Bearer {key}"}
    started, ttft, final = time.perf_counter(), None, None
    with httpx.stream("POST", f"{url}/v1/responses", json=body, headers=headers, timeout=600) as answer:
        if answer.status_code != 200:
            raise RuntimeError(f"/v1/responses answered {answer.status_code}: {answer.read().decode()}")
        executor = answer.headers.get("x-kvserve-executor")
        for line in answer.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line.removeprefix("data: "))
            if event["type"] == "response.output_text.delta" and ttft is None:
                ttft = time.perf_counter() - started
            if event["type"] in ("response.completed", "response.incomplete"):
                final = event["response"]
            if event["type"] == "error":
                raise RuntimeError(f"the stream failed: {event}")
    if final is None:
        raise RuntimeError("the stream ended without response.completed")
    return {"executor": executor, "ttft_s": ttft or time.perf_counter() - started, "response": final}


def conversation(url: str, key: str, turns: int, max_output_tokens: int) -> list[dict]:
    rows, previous = [], None
    for k in range(turns):
        body = {
            "instructions": INSTRUCTIONS,
            "input": question(k),
            "max_output_tokens": max_output_tokens,
            "temperature": 0,
            "stream": True,
        }
        if previous is not None:
            body["previous_response_id"] = previous["id"]
        served = turn(url, key, body)
        usage = served["response"]["usage"]
        # the previous turn's prompt and answer: the prefix this turn's prompt shares with it
        shared = previous["usage"]["input_tokens"] + previous["usage"]["output_tokens"] if previous else 0
        rows.append(
            {
                "turn": k + 1,
                "executor": served["executor"],
                "prompt_tokens": usage["input_tokens"],
                "cached_tokens": usage["input_tokens_details"]["cached_tokens"],
                "previous_tokens": shared,
                "ttft_ms": round(served["ttft_s"] * 1000, 1),
            }
        )
        previous = served["response"]
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'turn':>4} {'executor':<24} {'prompt':>7} {'cached':>7} {'prev+out':>8} {'ttft ms':>8}")
    for row in rows:
        print(
            f"{row['turn']:>4} {row['executor']:<24} {row['prompt_tokens']:>7} {row['cached_tokens']:>7} "
            f"{row['previous_tokens']:>8} {row['ttft_ms']:>8}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--max-output-tokens", type=int, default=32)
    parser.add_argument("--executors", type=int, default=2)
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--up-args", default="", help="more `kvserve up` flags, one string")
    parser.add_argument("--log", type=Path, default=Path("bench-logs/responses_conversation.log"))
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = parser.parse_args()
    extra = ["--executors", str(args.executors), *shlex.split(args.up_args)]
    with tenant_stack(["conversation"], args.log, args.model, extra) as stack:
        wait_for_executors(stack.url, args.executors)
        rows = conversation(stack.url, stack.keys["conversation"], args.turns, args.max_output_tokens)
    print_table(rows)
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
