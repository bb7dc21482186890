"""What the LoRA benchmark sends to a server, the same to kvserve and to vLLM: the arms' streams and the load probe.

An arm is --streams closed-loop streams, each sending --rounds completions one after the other; request i (round
r, stream s: i = r x streams + s) runs under adapter i mod k of the arm's k adapters (the base model when k = 0), so
every round spreads its requests evenly over the adapters. Every request has a prompt of its own (about
--prompt-tokens common words, one token each; bench/prompts.py) and exactly --max-tokens output tokens
(ignore_eos): no request finds another's blocks in the prefix cache, within an arm or across arms, and every arm
does the same work.

The load probe runs on an idle server before any arm, one request at a time: the base model a few times, then each
adapter twice, first while it is not loaded, then again. An adapter's load time is its first request's TTFT less its
second's (same prompt length, the adapter resident: what remains is reading and laying out its weights); the first
request's TTFT less the base model's is reported beside it, as the whole cost a tenant sees.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass

import httpx

from bench.load import LoadConfig, auth_headers, request_body
from bench.metrics import RequestResult, summarize
from bench.prompts import one_token_per_word, shared_prefixes
from bench.stream import stream_request

ARM_ADAPTERS = (0, 1, 4, 8)  # adapters per arm; 0: the base model only
PROBE_BASE_REQUESTS = 3
PROBE_MAX_TOKENS = 2  # the probe reads TTFT only
PROBE_STREAM = 999  # the probe's prompts, apart from every arm's
TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class Shape:
    streams: int = 16
    rounds: int = 3
    prompt_tokens: int = 128
    max_tokens: int = 128

    @property
    def requests(self) -> int:
        return self.streams * self.rounds


@dataclass(frozen=True, slots=True)
class Target:
    """Where to send: the server's base URL, the key (None: an open server) and the base model's name."""

    url: str
    key: str | None
    base_model: str


def arm_name(adapters: int) -> str:
    return "base only" if adapters == 0 else f"{adapters} adapter" + ("s" if adapters > 1 else "")


def prompts(count: int, tokens: int, seed: int, stream: int) -> list[str]:
    """`count` prompts of about `tokens` tokens; another `stream` (an arm's adapter count, the probe's
    PROBE_STREAM) draws other texts."""
    return shared_prefixes(count, tokens, seed * 1000 + stream, one_token_per_word)


def arm_models(base_model: str, adapters: list[str], requests: int) -> list[str]:
    """Each request's `model`: the adapters in turn, or the base model when there are none."""
    return [adapters[i % len(adapters)] if adapters else base_model for i in range(requests)]


def _body(target: Target, model: str, text: str, max_tokens: int) -> dict:
    config = LoadConfig(
        target.url, model, endpoint="completions", max_tokens=max_tokens, temperature=0.0, ignore_eos=True
    )
    return request_body(config, text)


def _client(target: Target, streams: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    return httpx.AsyncClient(
        base_url=target.url, headers=auth_headers(target.key), timeout=TIMEOUT_S, limits=limits
    )


async def run_arm(target: Target, adapters: list[str], shape: Shape, seed: int) -> dict:
    """One arm: its requests' results and bench.metrics' summary of them."""
    models = arm_models(target.base_model, adapters, shape.requests)
    texts = prompts(shape.requests, shape.prompt_tokens, seed, len(adapters))
    results: list[RequestResult] = []
    async with _client(target, shape.streams) as client:
        start = time.perf_counter()

        async def stream(s: int) -> None:
            for r in range(shape.rounds):
                i = r * shape.streams + s
                body = _body(target, models[i], texts[i], shape.max_tokens)
                results.append(await stream_request(client, "/v1/completions", body, i, start))

        await asyncio.gather(*(stream(s) for s in range(shape.streams)))
        duration = time.perf_counter() - start
    results.sort(key=lambda r: r.index)
    return {
        "adapters": adapters,
        "summary": summarize(results, duration),
        "requests": [r.to_json() for r in results],
    }


async def probe_load(target: Target, adapters: list[str], prompt_tokens: int, seed: int) -> dict:
    """TTFTs of requests sent alone: the base model's, then each adapter's first (not loaded) and second."""
    texts = iter(prompts(PROBE_BASE_REQUESTS + 2 * len(adapters), prompt_tokens, seed, PROBE_STREAM))
    errors: list[str] = []

    async def ttft(client: httpx.AsyncClient, model: str) -> float | None:
        body = _body(target, model, next(texts), PROBE_MAX_TOKENS)
        result = await stream_request(client, "/v1/completions", body, 0, time.perf_counter())
        if result.error is not None:
            errors.append(f"{model}: {result.error}")
        return result.ttft

    async with _client(target, 1) as client:
        base = [await ttft(client, target.base_model) for _ in range(PROBE_BASE_REQUESTS)]
        first, loaded = {}, {}
        for name in adapters:
            first[name] = await ttft(client, name)
            loaded[name] = await ttft(client, name)
    return load_summary(base, first, loaded, errors)


def load_summary(
    base: list[float | None],
    first: dict[str, float | None],
    loaded: dict[str, float | None],
    errors: list[str],
) -> dict:
    """Medians in seconds (None where nothing was measured) and every TTFT the probe saw."""

    def median(values) -> float | None:
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    loads = [first[n] - loaded[n] for n in first if first[n] is not None and loaded[n] is not None]
    base_ttft, first_ttft = median(base), median(first.values())
    return {
        "base_ttft_s": base_ttft,
        "first_use_ttft_s": first_ttft,
        "loaded_ttft_s": median(loaded.values()),
        "load_s": median(loads),
        "first_use_minus_base_s": None if base_ttft is None or first_ttft is None else first_ttft - base_ttft,
        "base_ttfts_s": base,
        "first_use_ttfts_s": first,
        "loaded_ttfts_s": loaded,
        "errors": errors,
    }


async def measure(target: Target, names: list[str], shape: Shape, arms: tuple[int, ...], seed: int) -> dict:
    """The load probe over every adapter, then each arm, one after the other on the same server."""
    report: dict = {"load": await probe_load(target, names, shape.prompt_tokens, seed), "arms": {}}
    for count in arms:
        print(f"  {arm_name(count)}: {shape.streams} streams x {shape.rounds} rounds", flush=True)
        report["arms"][arm_name(count)] = await run_arm(target, names[:count], shape, seed)
    return report
