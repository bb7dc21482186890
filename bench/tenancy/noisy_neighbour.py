"""Noisy neighbour: what one tenant's flood of long unique prompts does to another tenant's steady chat.

One `kvserve up` with keys required (bench/tenancy/tenant_stack.py) per mode: fair share and KV shares off,
then on. In each, the victim runs alone, then under the flood:
- the victim: a closed loop of short chat requests sharing one long system prompt (prefix A), plus a request on a
  second long prefix (B) it returns to only every --occasional-every seconds;
- the aggressor (in a process of its own, so its client work is not counted in the victim's event loop):
  --flood-streams concurrent closed loops of unique long prompts.
Reported per mode and phase: the victim's TTFT and ITL p50/p90, its cached share of prompt tokens on A and on B, the
aggressor's TTFT p90, and errors.

    python -m bench.tenancy.noisy_neighbour --out bench/results/noisy-neighbour.json
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.metrics import RequestResult, percentile
from bench.prompts import one_token_per_word, shared_prefixes
from bench.stream import stream_request
from bench.tenancy.tenant_stack import tenant_stack

CHAT = "/v1/chat/completions"
MODES = {"off": ["--no-fair-share", "--no-kv-shares"], "on": []}


@dataclass(slots=True)
class Phase:
    """The victim's requests on each prefix, and the aggressor's, in one phase."""

    a: list[RequestResult] = field(default_factory=list)
    b: list[RequestResult] = field(default_factory=list)
    aggressor: list[dict] = field(default_factory=list)


def chat_body(model: str, system: str, question: str, max_tokens: int) -> dict:
    return {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def victim_loop(
    client: httpx.AsyncClient, args, prefixes: list[str], phase: Phase, until: float
) -> None:
    """Prefix A in a closed loop; prefix B every --occasional-every seconds, alongside."""
    run_start = time.perf_counter()

    async def steady() -> None:
        i = 0
        while time.monotonic() < until:
            body = chat_body(args.model, prefixes[0], f"Question {i}: what comes next?", args.victim_tokens)
            phase.a.append(await stream_request(client, CHAT, body, i, run_start))
            i += 1

    async def occasional() -> None:
        i = 0
        while time.monotonic() + args.occasional_every < until:
            await asyncio.sleep(args.occasional_every)
            body = chat_body(args.model, prefixes[1], f"Occasional {i}: and then?", args.victim_tokens)
            phase.b.append(await stream_request(client, CHAT, body, i, run_start))
            i += 1

    await asyncio.gather(steady(), occasional())


def aggressor_in_process(
    url: str,
    key: str,
    model: str,
    streams: int,
    prompt_tokens: int,
    max_tokens: int,
    seed: int,
    until_wall: float,
) -> list[dict]:
    """The flood, run in a spawned process until until_wall (time.time()): each request's TTFT and error."""

    async def flood() -> list[dict]:
        results: list[dict] = []
        headers = {"authorization": f"Bearer {key}"}
        limits = httpx.Limits(max_connections=streams + 4)
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as client:
            run_start = time.perf_counter()

            async def stream(s: int) -> None:
                i = 0
                while time.time() < until_wall:
                    prompt = shared_prefixes(
                        1, prompt_tokens, seed * 1_000_003 + s * 10_007 + i, one_token_per_word
                    )
                    body = chat_body(model, prompt[0], "Summarise.", max_tokens)
                    result = await stream_request(client, CHAT, body, i, run_start)
                    results.append({"ttft": result.ttft, "error": result.error})
                    i += 1

            await asyncio.gather(*(stream(s) for s in range(streams)))
        return results

    return asyncio.run(flood())


def cached_share(results: list[RequestResult]) -> float | None:
    done = [r for r in results if r.ok and r.prompt_tokens]
    prompt = sum(r.prompt_tokens for r in done)
    return sum(r.cached_tokens or 0 for r in done) / prompt if prompt else None


def _p(values: list[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def summarise(phase: Phase) -> dict:
    victim = [r for r in phase.a + phase.b if r.ok]
    ttfts = [r.ttft for r in victim if r.ttft is not None]
    itls = [gap for r in victim for gap in r.itl]
    aggressor_ttfts = [r["ttft"] for r in phase.aggressor if r["error"] is None and r["ttft"] is not None]
    return {
        "victim_requests": len(phase.a) + len(phase.b),
        "victim_errors": sum(1 for r in phase.a + phase.b if not r.ok),
        "victim_error_examples": [r.error for r in phase.a + phase.b if not r.ok][:3],
        "victim_ttft_p50": _p(ttfts, 50),
        "victim_ttft_p90": _p(ttfts, 90),
        "victim_itl_p50": _p(itls, 50),
        "victim_itl_p90": _p(itls, 90),
        "cached_share_a": cached_share(phase.a),
        "cached_share_b": cached_share(phase.b),
        "aggressor_requests": len(phase.aggressor),
        "aggressor_errors": sum(1 for r in phase.aggressor if r["error"] is not None),
        "aggressor_error_examples": [r["error"] for r in phase.aggressor if r["error"]][:3],
        "aggressor_ttft_p90": _p(aggressor_ttfts, 90),
    }


async def run_mode(args, url: str, keys: dict[str, str], pool: concurrent.futures.Executor) -> dict:
    prefixes = shared_prefixes(2, args.prefix_tokens, args.seed, one_token_per_word)
    headers = {"authorization": f"Bearer {keys['victim']}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as client:
        warm = Phase()
        await victim_loop(
            client, args, prefixes, warm, time.monotonic() + 1
        )  # the prefixes cached, once each
        body = chat_body(args.model, prefixes[1], "Warm.", args.victim_tokens)
        warm.b.append(await stream_request(client, CHAT, body, 0, time.perf_counter()))
        if any(not r.ok for r in warm.a + warm.b):
            raise RuntimeError(
                f"the victim's warm-up failed: {[r.error for r in warm.a + warm.b if not r.ok]}"
            )
        alone = Phase()
        await victim_loop(client, args, prefixes, alone, time.monotonic() + args.alone_s)
        print(f"  alone: {json.dumps(summarise(alone))}", flush=True)
        flood = Phase()
        until_wall = time.time() + args.ramp_s + args.flood_s
        aggressor = asyncio.wrap_future(
            pool.submit(
                aggressor_in_process,
                url,
                keys["aggressor"],
                args.model,
                args.flood_streams,
                args.flood_prompt_tokens,
                args.flood_tokens,
                args.seed,
                until_wall,
            )
        )
        await asyncio.sleep(args.ramp_s)  # the flood fills the queues and the cache first
        await victim_loop(client, args, prefixes, flood, time.monotonic() + args.flood_s)
        flood.aggressor = await aggressor
        print(f"  flood: {json.dumps(summarise(flood))}", flush=True)
    return {"alone": summarise(alone), "flood": summarise(flood)}


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def markdown_table(report: dict) -> str:
    rows = [
        "| fair share, KV shares | phase | victim TTFT p50 / p90 | victim ITL p50 / p90 | cached A | cached B "
        "| aggressor TTFT p90 | errors (victim, aggressor) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, phases in report["modes"].items():
        for name, m in phases.items():
            rows.append(
                f"| {mode} | {name} | {_s(m['victim_ttft_p50'])} / {_s(m['victim_ttft_p90'])} "
                f"| {_s(m['victim_itl_p50'])} / {_s(m['victim_itl_p90'])} | {_share(m['cached_share_a'])} "
                f"| {_share(m['cached_share_b'])} | {_s(m['aggressor_ttft_p90'])} "
                f"| {m['victim_errors']}, {m['aggressor_errors']} |"
            )
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.tenancy.noisy_neighbour",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--modes", default="off,on", help="which of off,on to run, in order")
    parser.add_argument(
        "--kv-cache-memory",
        default="384MiB",
        help="the executor's KV pool: about a third of the flood's prompts",
    )
    parser.add_argument(
        "--queue-timeout",
        type=float,
        default=300.0,
        help="the gateway's: the flood is held at the gateway for the run, not refused, so errors are failures",
    )
    parser.add_argument("--prefix-tokens", type=int, default=800, help="each of the victim's two prefixes")
    parser.add_argument("--victim-tokens", type=int, default=32, help="output tokens per victim request")
    parser.add_argument(
        "--occasional-every", type=float, default=6.0, help="seconds between prefix B requests"
    )
    parser.add_argument("--flood-streams", type=int, default=16)
    parser.add_argument("--flood-prompt-tokens", type=int, default=1500, help="each unique aggressor prompt")
    parser.add_argument("--flood-tokens", type=int, default=32, help="output tokens per aggressor request")
    parser.add_argument("--alone-s", type=float, default=20.0, help="seconds of the victim alone")
    parser.add_argument(
        "--ramp-s", type=float, default=5.0, help="seconds of flood before the victim is measured"
    )
    parser.add_argument("--flood-s", type=float, default=40.0, help="seconds of the victim under the flood")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="the served model name")
    parser.add_argument("--up-args", default="", help="more `kvserve up` flags, as one string")
    parser.add_argument("--log-dir", type=Path, default=Path("bench/results"), help="kvserve up's output")
    parser.add_argument("--out", type=Path, default=None, help="also write the results here as JSON")
    return parser


def _stop_on_sigterm(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through the stack's cleanup, as Ctrl-C does


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        print(f"--modes: expected some of {', '.join(MODES)}, got {args.modes!r}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "modes": {}}
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        for mode in modes:
            extra = ["--kv-cache-memory", args.kv_cache_memory, "--queue-timeout", str(args.queue_timeout)]
            extra += [*MODES[mode], *args.up_args.split()]
            log = args.log_dir / f"noisy-neighbour-{mode}-up.log"
            with tenant_stack(["victim", "aggressor"], log, extra_args=extra) as stack:
                print(f"mode {mode}: kvserve up at {stack.url} {' '.join(extra)}", flush=True)
                report["modes"][mode] = asyncio.run(run_mode(args, stack.url, stack.keys, pool))
    table = markdown_table(report)
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**report, "table": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
