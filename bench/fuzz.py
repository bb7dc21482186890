"""Bad requests against a kvserve gateway, from a seeded generator, over both completion endpoints: every answer
must be a 4xx in OpenAI's error shape (or a whole 200 where the input turned out valid), never a 5xx; afterwards
the executors must hold no KV blocks and a plain request must still be served.

    python -m bench.fuzz --url http://127.0.0.1:8000 --requests 2000 [--seed 0] [--concurrency 8] \\
        [--metrics-url http://127.0.0.1:9100/metrics]

Each request starts from a valid body (a few output tokens, so the valid ones stay cheap) and takes one to three
mutations: wrong types, missing fields, huge and non-finite numbers, deep nesting, lone surrogates, invalid
UTF-8, truncated or non-object JSON, wrong content types, unknown fields, bad max_tokens, logprobs, stop,
logit_bias, messages' roles and content parts. tests/gateway/test_fuzz_stack.py runs the same generator in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
WORDS = ("the", "cache", "block", "token", "prefix", "robot", "page", "é", "日本", "🙂", "\n", "{{ x }}")

# values of every JSON kind, each wrong somewhere
ODD_VALUES = [None, True, False, 0, -1, 1.5, "", "x", "16", [], [1], {}, {"a": 1}, [[[]]], "\u0000", "NaN"]
HUGE_NUMBERS = [1e308, -1e308, 10**20, 2**63, 2**64, -(2**63) - 1, 10**400, -(10**400), 5e-324, 1e30, -1e30]
SURROGATES = [
    "\ud800",
    "\udfff",
    "x\ud800y",
    "\udc00\ud800",
    "\ud83d",
]  # lone halves; json.dumps escapes them
INVALID_UTF8 = [
    b"\xff",
    b"\xed\xa0\x80",
    b"\xc0\x80",
    b"\xe2\x82",
    b"\xf8\x88\x80\x80\x80",
    b"\x80",
    b"\xfe\xff",
]
CONTENT_TYPES = [
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/jsonx",
    "",
    None,  # no header: read as JSON
    "APPLICATION/JSON",
    "application/json; charset=utf-8",
]
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "n",
    "best_of",
    "user",
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "stream_options",
    "logit_bias",
    "stop",
    "logprobs",
    "top_logprobs",
    "echo",
    "suffix",
    "response_format",
    "tools",
    "tool_choice",
    "model",
)
# what JSON text built by json.dumps cannot hold (invalid UTF-8, nesting deeper than json.dumps recurses) goes in
# as a placeholder string, swapped for its bytes after dumping
RawParts = dict[str, bytes]


@dataclass(frozen=True, slots=True)
class FuzzRequest:
    path: str
    body: bytes
    content_type: str | None
    kind: str  # the mutations it took, for the report
    method: str = "POST"


@dataclass(slots=True)
class FuzzReport:
    statuses: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)  # every answer that broke the rules, and why
    seconds: float = 0.0


# -- the generator -------------------------------------------------------------------------------------------


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))


def _base(rng: random.Random, path: str, model: str) -> dict:
    body = {"model": model, "max_tokens": rng.randint(1, 4), "temperature": rng.choice([0, 0.7])}
    if path == ENDPOINTS[0]:
        body["messages"] = [{"role": "user", "content": _text(rng)}]
    else:
        body["prompt"] = _text(rng)
    return body


def _raw(parts: RawParts, raw: bytes) -> str:
    placeholder = f"@@raw-{len(parts)}@@"
    parts[placeholder] = raw
    return placeholder


def _nested(rng: random.Random) -> bytes:
    depth = rng.choice([65, 300, 2_000, 50_000, 100_000])
    if rng.random() < 0.5:
        return b"[" * depth + b"1" + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


def _text_field(body: dict) -> tuple[dict | list, str | int]:
    """Where the body's user text lives: (container, key)."""
    if "messages" in body and isinstance(body["messages"], list) and body["messages"]:
        message = body["messages"][0]
        if isinstance(message, dict):
            return message, "content"
    return body, "prompt"


def _wrong_type(rng, body, parts):
    body[rng.choice(SAMPLING_FIELDS)] = rng.choice(ODD_VALUES)


def _huge(rng, body, parts):
    body[rng.choice(SAMPLING_FIELDS)] = rng.choice(HUGE_NUMBERS)


def _missing(rng, body, parts):
    body.pop(rng.choice(["model", "messages", "prompt"]), None)


def _unknown_field(rng, body, parts):
    body[rng.choice(["foo", "metadata", "store", "x" * 300, "", "\u00e9"])] = rng.choice(
        ODD_VALUES + [_text(rng)]
    )


def _deep(rng, body, parts):
    body[rng.choice(["prompt", "messages", "stop", "logit_bias", "metadata", "tools"])] = _raw(
        parts, _nested(rng)
    )


def _surrogate(rng, body, parts):
    container, key = _text_field(body)
    where = rng.choice(["text", "stop", "model", "key", "user"])
    value = rng.choice(SURROGATES)
    if where == "text":
        container[key] = value
    elif where == "key":
        body[value] = 1
    else:
        body[where] = value


def _invalid_utf8(rng, body, parts):
    container, key = _text_field(body)
    container[key] = _raw(parts, b'"ok ' + rng.choice(INVALID_UTF8) + b' ok"')


def _max_tokens(rng, body, parts):
    name = rng.choice(["max_tokens", "max_completion_tokens"])
    body[name] = rng.choice([-1, 0, 10**6, 2**31, 2**63, 2**64, -(2**63), 1.5, "4", True, [4], 1025, 1024])


def _logprobs(rng, body, parts):
    if "messages" in body:
        body["logprobs"] = rng.choice([True, False, 1, "yes", None])
        body["top_logprobs"] = rng.choice([None, 0, 5, 20, 21, -1, "5", 1.5, 10**20])
    else:
        body["logprobs"] = rng.choice([0, 5, 20, 21, -1, "3", 2.5, True, [1], 10**30])


def _stop(rng, body, parts):
    body["stop"] = rng.choice(["", [""], [1], [["a"]], {"a": 1}, "x" * 10_000, ["a"] * 50, [None], "\n", 5])


def _logit_bias(rng, body, parts):
    body["logit_bias"] = rng.choice(
        [
            {"a": 1},
            {"5": 1000},
            {"-1": 1},
            {"99999999": 1},
            [1],
            {"5": "x"},
            {"5": None},
            {"1" * 40: 1},
            {"5": 100},
        ]
    )


def _messages(rng, body, parts):
    if "messages" not in body:
        body["prompt"] = rng.choice(
            ["", [], [-1], [10**9], [1, "a"], [[1, 2], [3]], [True], ["a", "b"], {"x": 1}, [5] * 2_000, 7]
        )
        return
    role = rng.choice(["robot", "", None, 5, "USER", "tool", "assistant", "system", "developer", "function"])
    content = rng.choice(
        [
            None,
            5,
            [],
            "",
            {"text": "x"},
            [{"type": "image_url", "image_url": {"url": "http://x"}}],
            [{"type": "text"}],
            [{"type": "text", "text": 5}],
            ["plain"],
            [{"type": "text", "text": "a"}, {"type": "input_audio"}],
            _text(rng),
        ]
    )
    message = {"role": role, "content": content}
    body["messages"] = rng.choice(
        [[message], [], "hi", [message] * rng.randint(2, 300), [1], [{"role": "user"}], {"role": "user"}]
    )


def _features(rng, body, parts):
    name, value = rng.choice(
        [
            ("n", 2),
            ("best_of", 3),
            ("echo", True),
            ("suffix", "end"),
            ("response_format", {"type": "json_object"}),
            ("response_format", {"type": "text"}),
            ("tools", [{"type": "function", "function": {"name": "f"}}]),
            ("functions", [{"name": "f"}]),
            ("stream_options", {"include_usage": True}),
            ("stream_options", {"include_usage": "yes"}),
            ("stream", True),
            ("stream", "true"),
            ("model", "gpt-4o"),
            ("model", "x" * 50_000),
        ]
    )
    body[name] = value


BODY_MUTATIONS: dict[str, Callable[[random.Random, dict, RawParts], None]] = {
    "wrong-type": _wrong_type,
    "huge-number": _huge,
    "missing-field": _missing,
    "unknown-field": _unknown_field,
    "deep-nesting": _deep,
    "surrogate": _surrogate,
    "invalid-utf8": _invalid_utf8,
    "max-tokens": _max_tokens,
    "logprobs": _logprobs,
    "stop": _stop,
    "logit-bias": _logit_bias,
    "messages-or-prompt": _messages,
    "unsupported-feature": _features,
}


def _raw_mutation(rng: random.Random, raw: bytes) -> tuple[str, bytes]:
    """A mutation of the bytes themselves: what no dict can spell."""
    kind = rng.choice(["truncated", "not-an-object", "garbage", "non-finite", "long-number", "empty", "bom"])
    if kind == "truncated":
        return kind, raw[: rng.randint(0, max(0, len(raw) - 1))]
    if kind == "not-an-object":
        return kind, rng.choice([b"[]", b'"x"', b"1", b"null", b"true", b"[" + raw + b"]"])
    if kind == "garbage":
        return kind, bytes(rng.randint(0, 255) for _ in range(rng.randint(1, 200)))
    if kind == "non-finite":
        return kind, raw.replace(
            b'"temperature": 0', rng.choice([b'"temperature": NaN', b'"temperature": -Infinity'])
        )
    if kind == "long-number":
        return kind, raw[:-1] + b', "seed": ' + b"9" * rng.choice([400, 4_000, 5_000]) + b"}"
    if kind == "empty":
        return kind, b""
    return kind, b"\xef\xbb\xbf" + raw


def bad_requests(seed: int, count: int, model: str) -> list[FuzzRequest]:
    """`count` requests, the same ones for the same seed."""
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        path = rng.choice(ENDPOINTS)
        body = _base(rng, path, model)
        kinds = rng.sample(sorted(BODY_MUTATIONS), rng.randint(1, 3))
        parts: RawParts = {}
        for kind in kinds:
            BODY_MUTATIONS[kind](rng, body, parts)
        raw = json.dumps(body).encode()
        for placeholder, replacement in parts.items():
            raw = raw.replace(json.dumps(placeholder).encode(), replacement)
        if rng.random() < 0.15:
            kind, raw = _raw_mutation(rng, raw)
            kinds.append(kind)
        content_type = "application/json"
        if rng.random() < 0.1:
            content_type = rng.choice(CONTENT_TYPES)
            kinds.append(f"content-type {content_type!r}")
        method = "POST"
        if rng.random() < 0.01:
            method, path = rng.choice([("GET", path), ("PUT", path), ("POST", "/v1/nowhere")])
            kinds.append(f"{method} {path}")
        requests.append(FuzzRequest(path, raw, content_type, "+".join(kinds), method))
    if count:  # one body over the size limit, sent once
        requests[rng.randrange(count)] = FuzzRequest(
            ENDPOINTS[1], b" " * (4 * 1024 * 1024 + 1), None, "oversize"
        )
    return requests


# -- the checks -----------------------------------------------------------------------------------------------


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
    parser = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__.split("\n\n")[0])
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
