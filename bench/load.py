"""`kvserve bench`: a load generator for any OpenAI-compatible server (kvserve's gateway, vLLM, ...).

Closed loop (--concurrency N: N clients, each sending its next request when the last one ends) or open loop
(--request-rate R: Poisson arrivals at R per second, `inf` for all at once, optionally capped by --concurrency).
The run ends after --num-requests requests or --duration seconds, whichever comes first; after --duration no new
request starts and the ones in flight finish. Every request streams with include_usage; see bench/metrics.py
for how the numbers are defined.

    kvserve bench --url http://127.0.0.1:8000 --concurrency 32 --num-requests 64 --max-tokens 64 \\
        --prompt "Write a short story about a robot." --ignore-eos --output run.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Protocol, TextIO

import httpx

from bench.metrics import RequestResult, format_summary, summarize
from bench.prompts import FixedPrompt, PrefixWorkload, Prompt, one_token_per_word, tokenizer_counter
from bench.server_metrics import added_latency_summary, scrape_histogram
from bench.stream import stream_request

DEFAULT_NUM_REQUESTS = 100


@dataclass(slots=True)
class LoadConfig:
    url: str  # base URL, e.g. http://127.0.0.1:8000
    model: str
    endpoint: str = "chat"  # or "completions"
    api_key: str | None = None
    concurrency: int | None = None
    ramp_up: float = 0.0  # closed loop: client k starts k * ramp_up / concurrency seconds in
    request_rate: float | None = None
    num_requests: int | None = None
    duration: float | None = None
    seed: int = 0
    max_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = False
    timeout: float = 600.0

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"


class Workload(Protocol):
    """Whatever gives request i its prompt: PrefixWorkload, FixedPrompt."""

    def prompt(self, i: int) -> Prompt: ...


def request_body(config: LoadConfig, text: str) -> dict:
    body: dict = {
        "model": config.model,
        "max_tokens": config.max_tokens,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if config.ignore_eos:
        body["ignore_eos"] = True  # kvserve's and vLLM's extension: exactly max_tokens per request
    return body


def base_url(url: str) -> str:
    """Accepts http://host:port with or without a trailing /v1."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def first_model(url: str, api_key: str | None, timeout: float = 30.0) -> str:
    """The first id that GET /v1/models lists: what to ask for when --model is not given."""
    async with httpx.AsyncClient(
        base_url=base_url(url), headers=auth_headers(api_key), timeout=timeout
    ) as client:
        response = await client.get("/v1/models")
        response.raise_for_status()
        models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{url}/v1/models lists no models; pass --model")
    return models[0]["id"]


class Progress:
    """One stderr line rewritten with \\r, at most ten times a second."""

    def __init__(self, total: int | None, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.total = total
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.start = time.perf_counter()
        self.done = self.failed = self.tokens = 0
        self._last_draw = 0.0
        self._width = 0  # of the line drawn last: a shorter one must blank its tail

    def update(self, result: RequestResult) -> None:
        self.done += 1
        self.failed += not result.ok
        self.tokens += result.output_tokens if result.ok else 0
        self.draw()

    def draw(self, final: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or (not final and now - self._last_draw < 0.1):
            return
        self._last_draw = now
        elapsed = now - self.start
        of = f"/{self.total}" if self.total is not None else ""
        line = (
            f"{self.done}{of} requests, {self.failed} failed, {elapsed:.1f} s, "
            f"{self.tokens / elapsed if elapsed > 0 else 0:.1f} output tok/s"
        )
        self.stream.write("\r" + line.ljust(self._width) + ("\n" if final else ""))
        self._width = len(line)
        self.stream.flush()


async def run_load(
    config: LoadConfig, workload: Workload, on_result: Callable[[RequestResult], None] = lambda r: None
) -> tuple[list[RequestResult], float]:
    """Sends the requests; returns them in send order and the wall time from the first send to the last end."""
    if config.num_requests is None and config.duration is None:
        raise ValueError("give --num-requests or --duration")
    if config.request_rate is None and config.concurrency is None:
        raise ValueError("give --concurrency or --request-rate")
    if config.request_rate == math.inf and config.num_requests is None:
        raise ValueError("--request-rate inf needs --num-requests")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    results: list[RequestResult] = []
    async with httpx.AsyncClient(
        base_url=base_url(config.url),
        headers=auth_headers(config.api_key),
        timeout=httpx.Timeout(config.timeout),
        limits=limits,
    ) as client:
        start = time.perf_counter()
        deadline = start + config.duration if config.duration is not None else math.inf
        next_index = 0

        def claim() -> int | None:
            """The next request's index, or None once the run is over."""
            nonlocal next_index
            if config.num_requests is not None and next_index >= config.num_requests:
                return None
            if time.perf_counter() >= deadline:
                return None
            next_index += 1
            return next_index - 1

        async def send(i: int) -> None:
            body = request_body(config, workload.prompt(i).text)
            result = await stream_request(client, config.path, body, i, start)
            results.append(result)
            on_result(result)

        if config.request_rate is None:
            await _closed_loop(config.concurrency or 1, config.ramp_up, claim, send)
        else:
            await _open_loop(config.request_rate, config.concurrency, config.seed, claim, send)
        duration = time.perf_counter() - start
    results.sort(key=lambda r: r.index)
    return results, duration


async def _closed_loop(
    concurrency: int,
    ramp_up: float,
    claim: Callable[[], int | None],
    send: Callable[[int], Awaitable[None]],
) -> None:
    """N clients, each sending its next request when its last one ends. Started all at once, clients whose
    requests have the same length stay in step and arrive in waves; a ramp-up staggers them."""

    async def client_loop(k: int) -> None:
        await asyncio.sleep(k * ramp_up / concurrency)
        while (i := claim()) is not None:
            await send(i)

    await asyncio.gather(*(client_loop(k) for k in range(concurrency)))


async def _open_loop(
    rate: float,
    concurrency: int | None,
    seed: int,
    claim: Callable[[], int | None],
    send: Callable[[int], Awaitable[None]],
) -> None:
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency) if concurrency else None

    async def gated(i: int) -> None:
        if gate is None:
            await send(i)
            return
        async with gate:
            await send(i)

    tasks = []
    while (i := claim()) is not None:
        tasks.append(asyncio.create_task(gated(i)))
        if rate != math.inf:
            await asyncio.sleep(rng.expovariate(rate))  # Poisson process: exponential gaps
    await asyncio.gather(*tasks)


def add_bench_args(bench: argparse.ArgumentParser) -> None:
    target = bench.add_argument_group("target")
    target.add_argument("--url", default="http://127.0.0.1:8000", help="base URL (default: %(default)s)")
    target.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    target.add_argument("--model", default=None, help="default: the first id GET /v1/models lists")
    target.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    target.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default: 600)")
    load = bench.add_argument_group("load")
    load.add_argument("--concurrency", type=int, default=None, help="closed loop: N clients back to back")
    load.add_argument(
        "--ramp-up", type=float, default=0.0, help="closed loop: start the clients evenly over S seconds"
    )
    load.add_argument(
        "--request-rate", type=float, default=None, help="Poisson arrivals per second; inf: all at once"
    )
    load.add_argument(
        "--num-requests", type=int, default=None, help=f"default: {DEFAULT_NUM_REQUESTS} without --duration"
    )
    load.add_argument("--duration", type=float, default=None, help="seconds; no new request after it")
    load.add_argument("--seed", type=int, default=0)
    prompts = bench.add_argument_group(
        "prompts", "a fixed --prompt, or synthetic groups with shared prefixes"
    )
    prompts.add_argument("--prompt", default=None, help="send this text in every request")
    prompts.add_argument(
        "--prefix-groups", type=int, default=1, help="request i uses group i mod G's prefix (default: 1)"
    )
    prompts.add_argument(
        "--prefix-tokens", type=int, default=256, help="shared prefix length per group (default: 256)"
    )
    prompts.add_argument(
        "--question-tokens", type=int, default=32, help="unique question per request (default: 32)"
    )
    prompts.add_argument(
        "--tokenizer", default=None, help="model directory whose tokenizer counts tokens (default: words)"
    )
    sampling = bench.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=128)
    sampling.add_argument("--temperature", type=float, default=0.0)
    sampling.add_argument("--ignore-eos", action="store_true", help="every request produces max_tokens")
    report = bench.add_argument_group("report")
    report.add_argument("--output", default=None, help="write config, summary and every request as JSON")
    report.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    bench.set_defaults(handler=bench_main)


def config_from_args(args: argparse.Namespace, model: str) -> LoadConfig:
    num_requests = args.num_requests
    if num_requests is None and args.duration is None:
        num_requests = DEFAULT_NUM_REQUESTS
    concurrency = args.concurrency
    if concurrency is None and args.request_rate is None:
        concurrency = 1
    return LoadConfig(
        url=args.url,
        model=model,
        endpoint=args.endpoint,
        api_key=args.api_key,
        concurrency=concurrency,
        ramp_up=args.ramp_up,
        request_rate=args.request_rate,
        num_requests=num_requests,
        duration=args.duration,
        seed=args.seed,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        timeout=args.timeout,
    )


def workload_from_args(args: argparse.Namespace) -> Workload:
    if args.prompt is not None:
        return FixedPrompt(args.prompt)
    count = tokenizer_counter(args.tokenizer) if args.tokenizer else one_token_per_word
    return PrefixWorkload(args.prefix_groups, args.prefix_tokens, args.question_tokens, args.seed, count)


def _check_args(args: argparse.Namespace) -> str | None:
    for name in ("concurrency", "num_requests", "max_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')} must be at least 1"
    if args.request_rate is not None and not args.request_rate > 0:
        return "--request-rate must be positive (or inf)"
    if args.ramp_up < 0:
        return "--ramp-up must not be negative"
    if args.duration is not None and not args.duration > 0:
        return "--duration must be positive"
    if args.request_rate == math.inf and args.num_requests is None:
        return "--request-rate inf needs --num-requests"
    return None


def bench_main(args: argparse.Namespace) -> int:
    """Exit 0 when at least one request completed, 1 when none did or the server is unreachable, 2 for bad flags."""
    if message := _check_args(args):
        print(f"kvserve bench: error: {message}", file=sys.stderr)
        return 2
    try:
        workload = workload_from_args(args)
    except (ValueError, OSError) as error:  # OSError: --tokenizer names no tokenizer
        print(f"kvserve bench: error: {error}", file=sys.stderr)
        return 2
    try:
        model = args.model or asyncio.run(first_model(args.url, args.api_key))
    except (httpx.HTTPError, RuntimeError, KeyError) as error:
        print(f"kvserve bench: error: cannot list models at {args.url}: {error}", file=sys.stderr)
        return 1
    config = config_from_args(args, model)
    progress = Progress(config.num_requests, enabled=not args.no_progress)
    server = base_url(args.url)
    before = asyncio.run(scrape_histogram(server))
    results, duration = asyncio.run(run_load(config, workload, progress.update))
    progress.draw(final=True)
    summary = summarize(results, duration)
    summary["gateway_added_latency"] = added_latency_summary(asyncio.run(scrape_histogram(server)), before)
    if args.output:
        with open(args.output, "w") as f:
            report = {"config": {**asdict(config), "api_key": None}, **summary}
            report["requests"] = [r.to_json() for r in results]
            json.dump(report, f, indent=2)
    print(format_summary(summary))
    return 0 if summary["completed"] > 0 else 1


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.load ...`, the same as `kvserve bench ...`."""
    parser = argparse.ArgumentParser(prog="kvserve bench")
    add_bench_args(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
