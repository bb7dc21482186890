"""The hostile requests of issues 27 and 49, as bytes: each attack's bodies are built and encoded before it starts, so
what the benchmark measures is the server's cost of them, not this process's JSON encoder (which shares the CPU).
Random parts come from a seeded generator: the same bodies every run, before and after a fix."""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable
from dataclasses import dataclass, field

CHAT = "/v1/chat/completions"
# the gateway answers 413 above this (docs/api.md): the flood stays just under
GATEWAY_BODY_LIMIT = 4 * 1024 * 1024
FLOOD_WORDS = ("cache", "block", "token", "prefix", "robot", "page", "kernel", "tenant", "queue", "stream")


def _size(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True, slots=True)
class Sizes:
    """How large each hostile input is; the defaults are the issue's. Each field is a command-line option."""

    vocab_size: int = _size(
        49_152, "case 1: logit_bias entries, one per token (the default model has 49,152)"
    )
    stop_strings: int = _size(200_000, "case 2: how many stop strings (3-8 random letters each)")
    stop_n: int = _size(32, "case 2: n")
    regex_classes: int = _size(160, "case 3: [^a]* classes in the regex (5 bytes each)")
    regex_requests: int = _size(16, "case 3: concurrent requests")
    distinct_regexes: bool = _size(
        False, "case 3: each request's regex starts at another letter (no cache hit)"
    )
    flood_requests: int = _size(
        16, "case 4: concurrent keyless requests, each sent again until --flood-seconds"
    )
    flood_body_bytes: int = _size(GATEWAY_BODY_LIMIT - 1024, "case 4: bytes per body")
    flood_seconds: float = _size(5.0, "case 4: how long new keyless requests keep being sent")
    logprobs_n: int = _size(32, "case 5: n")
    top_logprobs: int = _size(20, "case 5: top_logprobs")
    logprobs_max_tokens: int = _size(256, "case 5: max_tokens")
    tools: int = _size(2_000, "case 6a: how many tools")
    tool_properties: int = _size(
        8, "case 6a: parameters per tool, each described and enumerated (3.3 MiB at 2,000 x 8)"
    )
    tool_choice: str = _size(
        "required", "case 6a: tool_choice (required: the schemas also constrain the output)"
    )
    messages: int = _size(20_000, "case 6b: how many tiny messages")
    attack_max_tokens: int = _size(64, "cases 1, 2, 3, 6, 7, 8: the attacker's max_tokens")
    pattern_classes: int = _size(156, "cases 7, 8: [^a]* classes in the schema's string pattern")
    pattern_requests: int = _size(16, "case 7: concurrent json_schema requests")
    distinct_patterns: bool = _size(
        False, "case 7: each request's pattern starts at another letter (no shared compile)"
    )


@dataclass(frozen=True, slots=True)
class Attack:
    case: str
    description: str
    bodies: list[bytes]  # sent at once, each on a connection of its own
    keyed: bool = True  # False: sent without any API key
    repeat_s: float = 0.0  # > 0: each connection sends its body again until this many seconds have passed
    sends: int = 1  # each connection sends its body at least this many times, one after the other
    victim: str = "chat"  # the victim's request measured beside it: "chat" or "json_schema" (victim_body)

    @property
    def body_bytes(self) -> int:
        return len(self.bodies[0])


def chat_body(model: str, messages: list[dict], **fields) -> dict:
    """A streamed chat request that runs to max_tokens (ignore_eos), so every attack costs its full length."""
    return {
        "model": model,
        "messages": messages,
        "stream": True,
        "temperature": 1.0,
        "seed": 0,
        "ignore_eos": True,
        **fields,
    }


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _encode(body: dict) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _kb(size: int) -> str:
    return f"{size / 1024:,.0f} KB" if size < 1024 * 1024 else f"{size / 1024 / 1024:.1f} MiB"


def logit_bias(sizes: Sizes, model: str) -> Attack:
    rng = random.Random(1)
    bias = {str(token): round(rng.uniform(-1, 1), 1) for token in range(sizes.vocab_size)}
    body = _encode(
        chat_body(model, _user("Tell me about caches."), max_tokens=sizes.attack_max_tokens, logit_bias=bias)
    )
    return Attack("1", f"logit_bias x {sizes.vocab_size:,} ({_kb(len(body))})", [body])


def random_stop_strings(count: int, seed: int = 2) -> list[str]:
    """Short strings of letters and digits: none likely in the output, so every one is checked every token."""
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits
    return ["".join(rng.choices(alphabet, k=rng.randint(3, 8))) for _ in range(count)]


def stop_strings(sizes: Sizes, model: str) -> Attack:
    body = chat_body(
        model,
        _user("Write a long story about a robot."),
        max_tokens=sizes.attack_max_tokens,
        n=sizes.stop_n,
        stop=random_stop_strings(sizes.stop_strings),
    )
    raw = _encode(body)
    return Attack("2", f"stop x {sizes.stop_strings:,}, n = {sizes.stop_n} ({_kb(len(raw))})", [raw])


def class_regex(classes: int, first_letter: int = 0) -> str:
    """`[^a]*[^b]*[^c]*...`, cycling the alphabet: each class overlaps every other, so the automaton grows
    with the square of the count."""
    letters = string.ascii_lowercase
    return "".join(f"[^{letters[(first_letter + i) % len(letters)]}]*" for i in range(classes))


def constrained_body(sizes: Sizes, model: str, prompt: str, **constraint) -> bytes:
    """An attacker's chat of --attack-max-tokens with its output constrained (structured_outputs or
    response_format)."""
    return _encode(chat_body(model, _user(prompt), max_tokens=sizes.attack_max_tokens, **constraint))


def regex(sizes: Sizes, model: str) -> Attack:
    letters = range(sizes.regex_requests) if sizes.distinct_regexes else [0] * sizes.regex_requests
    regexes = [class_regex(sizes.regex_classes, first) for first in letters]
    bodies = [
        constrained_body(sizes, model, "Write anything.", structured_outputs={"regex": r}) for r in regexes
    ]
    size = len(class_regex(sizes.regex_classes))
    same = "distinct" if sizes.distinct_regexes else "one"
    return Attack(
        "3", f"{sizes.regex_requests} x regex ({same}, {sizes.regex_classes} classes, {size} B)", bodies
    )


def flood_body(model: str, size: int, seed: int = 4) -> bytes:
    """A chat body of `size` bytes whose one message is words: all of it is text to template and tokenize."""
    rng = random.Random(seed)
    empty = len(_encode(chat_body(model, _user(""), max_tokens=16)))
    text = " ".join(rng.choices(FLOOD_WORDS, k=size // 5))
    text = text[: max(0, size - empty)]
    return _encode(chat_body(model, _user(text), max_tokens=16))


def unauthenticated_flood(sizes: Sizes, model: str) -> Attack:
    body = flood_body(model, sizes.flood_body_bytes)
    description = (
        f"no key: {sizes.flood_requests} x {_kb(len(body))} chat bodies, for {sizes.flood_seconds:g} s"
    )
    return Attack("4", description, [body] * sizes.flood_requests, keyed=False, repeat_s=sizes.flood_seconds)


def top_logprobs(sizes: Sizes, model: str) -> Attack:
    body = chat_body(
        model,
        _user("Write a long story about a robot."),
        max_tokens=sizes.logprobs_max_tokens,
        n=sizes.logprobs_n,
        logprobs=True,
        top_logprobs=sizes.top_logprobs,
    )
    description = f"n = {sizes.logprobs_n}, top_logprobs = {sizes.top_logprobs}, max_tokens = {sizes.logprobs_max_tokens}"
    return Attack("5", description, [_encode(body)])


def big_tool(index: int, properties: int) -> dict:
    """A function whose parameters are `properties` described, enumerated fields: an API-sized schema."""
    fields = {
        f"field_{j}": {
            "type": "string",
            "description": f"Field {j} of operation {index}: what the caller wants done with it.",
            "enum": [f"option_{index}_{j}_{k}" for k in range(4)],
        }
        for j in range(properties)
    }
    return {
        "type": "function",
        "function": {
            "name": f"operation_{index}",
            "description": f"Operation {index} of a large API, with many fields.",
            "parameters": {"type": "object", "properties": fields, "required": list(fields)[:2]},
        },
    }


def tools(sizes: Sizes, model: str) -> Attack:
    body = chat_body(
        model,
        _user("Call the right operation."),
        max_tokens=sizes.attack_max_tokens,
        tools=[big_tool(i, sizes.tool_properties) for i in range(sizes.tools)],
        tool_choice=sizes.tool_choice,
    )
    raw = _encode(body)
    return Attack("6a", f"tools x {sizes.tools:,}, tool_choice {sizes.tool_choice} ({_kb(len(raw))})", [raw])


def many_messages(sizes: Sizes, model: str) -> Attack:
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(sizes.messages)
    ]
    if messages[-1]["role"] != "user":
        messages.append({"role": "user", "content": "hi"})
    raw = _encode(chat_body(model, messages, max_tokens=sizes.attack_max_tokens))
    return Attack("6b", f"messages x {len(messages):,} ({_kb(len(raw))})", [raw])


def json_schema_format(schema: dict, name: str = "answer") -> dict:
    """response_format for a JSON schema, as OpenAI's clients send it."""
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def pattern_schema(classes: int, first_letter: int = 0, title: str | None = None) -> dict:
    """An object with one string whose pattern is class_regex: a small schema that compiles for minutes."""
    schema = {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": f"^{class_regex(classes, first_letter)}$"}},
        "required": ["code"],
    }
    return schema if title is None else {"title": title, **schema}


def pattern_flood(sizes: Sizes, model: str) -> Attack:
    letters = range(sizes.pattern_requests) if sizes.distinct_patterns else [0] * sizes.pattern_requests
    formats = [json_schema_format(pattern_schema(sizes.pattern_classes, first)) for first in letters]
    bodies = [constrained_body(sizes, model, "Fill in the form.", response_format=f) for f in formats]
    same = "distinct" if sizes.distinct_patterns else "one"
    description = (
        f"{sizes.pattern_requests} x json_schema ({same}, pattern of {sizes.pattern_classes} classes) "
        'vs a json_schema {"ok": boolean}'
    )
    return Attack("7", description, bodies, victim="json_schema")


def refused_twice(sizes: Sizes, model: str) -> Attack:
    """One pathological schema sent, and once refused, sent again: the second answer's time is the case's.
    Titled apart from case 7's schemas, so that their refusal is not this one's (against a stack that ran this
    case before, the first answer is at once too)."""
    schema = pattern_schema(sizes.pattern_classes, title="refused twice")
    body = constrained_body(sizes, model, "Fill in the form.", response_format=json_schema_format(schema))
    description = f"json_schema (pattern of {sizes.pattern_classes} classes) refused, then sent again"
    return Attack("8", description, [body], sends=2)


ATTACKS: dict[str, Callable[[Sizes, str], Attack]] = {
    "1": logit_bias,
    "2": stop_strings,
    "3": regex,
    "4": unauthenticated_flood,
    "5": top_logprobs,
    "6a": tools,
    "6b": many_messages,
    "7": pattern_flood,
    "8": refused_twice,
}


def parse_cases(text: str) -> list[str]:
    """`1,3,6` -> ["1", "3", "6a", "6b"]: a number names its lettered cases too; order as ATTACKS lists them."""
    wanted = {part.strip() for part in text.split(",") if part.strip()}
    chosen = [case for case in ATTACKS if case in wanted or case.rstrip("ab") in wanted]
    unknown = {w for w in wanted if not any(c == w or c.rstrip("ab") == w for c in ATTACKS)}
    if unknown or not chosen:
        raise ValueError(f"--cases: unknown {sorted(unknown) or text!r}; choose from {', '.join(ATTACKS)}")
    return chosen
