"""Bad requests for a kvserve gateway, from a seeded generator, over both completion endpoints: the same ones for
the same seed. Each starts from a valid body (a few output tokens, so the valid ones stay cheap) and takes one to
three mutations: wrong types, missing fields, huge and non-finite numbers, deep nesting, lone surrogates, invalid
UTF-8, truncated or non-object JSON, wrong content types, unknown fields, bad max_tokens, logprobs, stop,
logit_bias, messages' roles and content parts. bench/faults/fuzz.py sends them and checks the answers."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

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
            (
                "response_format",
                {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no"}}},
            ),
            ("structured_outputs", {"regex": "(ab"}),
            ("structured_outputs", {"regex": "a", "choice": ["b"]}),
            ("guided_choice", ["yes", "no"]),
            ("guided_grammar", "root ::= undefined"),
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
