"""Hostile inputs from one tenant against another's latency (issues 27, 49): what the worst tenant does to the others.

Starts a one-executor `kvserve up` (default model, float32, CPU, a Redis of its own) with two API keys, alpha
the attacker and beta the victim (bench/tenancy/tenant_stack.py), or uses a running stack (--url with both
keys). The victim's request is a streamed chat of 32 tokens (temperature 0, ignore_eos); its latency alone is
the median of --reps. Case 7's victim is instead a streamed chat constrained by a json_schema `{"ok": boolean}`,
titled anew each time so that its grammar compiles each time (a cached one would wait for no compiler), with an
alone of its own. Then, per case: the attack starts from alpha in a process of its own
(bench/tenancy/hostile_bodies.py; case 4 sends no key at all), the victim's request follows --delay seconds
later, and everything is bounded: the victim by --timeout, the attack's requests by --delay + --timeout (then
their connections are closed). /health/live is polled throughout. Before the next case the stack must be quiet
again: the executors idle on /metrics and a victim request back near its time alone, within --settle-timeout
(reported as "quiet again after").

    python -m bench.tenancy.hostile_inputs [--cases 1,2,3,4,5,6,7,8] [--timeout 120] [--out FILE.json]
    python -m bench.tenancy.hostile_inputs --url http://127.0.0.1:8000 --alpha-key KEY --beta-key KEY [--metrics-url URL]

Prints a markdown table. "> T s": not done within T seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import multiprocessing
import shlex
import signal
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from bench.faults.fuzz import executor_load, idle
from bench.stream import stream_request
from bench.tenancy.hostile_attack import attack_in_process
from bench.tenancy.hostile_bodies import ATTACKS, CHAT, Attack, Sizes, json_schema_format, parse_cases
from bench.tenancy.hostile_report import Exchange, Victim, markdown_table
from bench.tenancy.tenant_stack import tenant_stack

VICTIM_PROMPT = "Write a short story about a robot."
LIVE_POLL_S = 0.25
# the stack is quiet again when a victim request takes at most this much more than alone: on a shared
# machine a latency exactly at its median is not to be expected
QUIET_FACTOR, QUIET_SLACK_S = 1.5, 0.25


@dataclass(slots=True)
class CaseResult:
    case: str
    description: str
    body_bytes: int
    attacker: list[Exchange]
    victim: Victim
    live_latencies: list[float]  # /health/live during the attack, in seconds
    quiet_after: (
        float | None
    )  # seconds from the attack's end until the stack was quiet; None: not within bound
    sends: int = 1  # each connection's requests, one after the other
    alone_s: float | None = None  # the case's victim alone, where it is not the chat's


@dataclass(slots=True)
class Setup:
    """What every measurement needs: where the stack is and who is who."""

    url: str
    metrics_url: str | None  # None: no executor load to read; quiet is judged by the victim's latency alone
    alpha_key: str
    victim: httpx.AsyncClient
    model: str
    victim_tokens: int
    delay: float
    timeout: float
    settle_timeout: float
    alone: float = 0.0  # the chat victim's median latency alone
    alone_by_kind: dict[str, float] = dataclasses.field(default_factory=dict)  # the other victims'
    probes: int = 0  # json_schema victims sent so far: each is titled with its number


def victim_body(model: str, max_tokens: int, kind: str = "chat", probe: int = 0) -> dict:
    """The chat victim runs to max_tokens; the json_schema one ends where its grammar does."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": VICTIM_PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": kind == "chat",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if kind == "json_schema":
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
        body["response_format"] = json_schema_format({"title": f"probe {probe}", **schema})
    return body


async def measure_victim(setup: Setup, timeout: float, kind: str = "chat") -> Victim:
    """The victim's streamed request, bounded: past the timeout the stream is closed."""
    setup.probes += kind == "json_schema"
    body = victim_body(setup.model, setup.victim_tokens, kind, setup.probes)
    started = time.perf_counter()
    request = stream_request(setup.victim, CHAT, body, 0, started)
    try:
        result = await asyncio.wait_for(request, max(timeout, 0.001))
    except TimeoutError:
        return Victim(None, error=f"not done within {timeout:g} s")
    error = result.error
    if error is None and kind == "chat" and result.output_tokens != setup.victim_tokens:
        error = f"{result.output_tokens} output tokens, not {setup.victim_tokens}"
    if error is None and not result.output_tokens:
        error = "no output tokens"
    return Victim(result.e2e, result.ttft, error)


async def alone(setup: Setup, reps: int, kind: str = "chat") -> list[Victim]:
    """The victim's request with no attack running, reps times; RuntimeError when one fails. A constrained
    victim's first request is not counted: the executor builds its grammar compiler on first use."""
    if kind != "chat":
        await measure_victim(setup, setup.timeout, kind)
    measured = [await measure_victim(setup, setup.timeout, kind) for _ in range(reps)]
    failed = [v.error for v in measured if v.error is not None]
    if failed:
        raise RuntimeError(f"the victim's {kind} request failed with no attack running: {failed[0]}")
    return measured


async def poll_live(url: str, latencies: list[float], timeout: float) -> None:
    """GET /health/live every LIVE_POLL_S until cancelled; a poll cut short by cancelling counts as far as it got."""
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        while True:
            sent = time.perf_counter()
            try:
                await client.get("/health/live")
            except httpx.HTTPError:
                pass  # its latency still says how long the gateway kept it waiting
            except asyncio.CancelledError:
                latencies.append(time.perf_counter() - sent)
                raise
            latencies.append(time.perf_counter() - sent)
            await asyncio.sleep(LIVE_POLL_S)


async def executors_idle(metrics_url: str, deadline: float) -> bool:
    """Whether /metrics shows every executor holding nothing before the deadline."""
    async with httpx.AsyncClient(timeout=5) as client:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if idle(executor_load((await client.get(metrics_url)).text)):
                    return True
            await asyncio.sleep(0.25)
    return False


async def wait_quiet(setup: Setup) -> float | None:
    """Seconds until the executors are idle and a victim request is back near its time alone; None: not within
    --settle-timeout (the next case then starts on a busy stack, and says so)."""
    started = time.monotonic()
    deadline = started + setup.settle_timeout
    if setup.metrics_url is not None and not await executors_idle(setup.metrics_url, deadline):
        return None
    while time.monotonic() < deadline:
        probe = await measure_victim(setup, deadline - time.monotonic())
        if probe.error is None and probe.latency <= setup.alone * QUIET_FACTOR + QUIET_SLACK_S:
            return time.monotonic() - started
    return None


async def run_case(attack: Attack, setup: Setup) -> CaseResult:
    started = time.monotonic()
    deadline = started + setup.delay + setup.timeout
    live: list[float] = []
    poller = asyncio.create_task(poll_live(setup.url, live, setup.timeout))
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as attacker:
        attacking = asyncio.get_running_loop().run_in_executor(
            attacker, attack_in_process, attack, setup.url, setup.alpha_key, started, deadline
        )
        try:
            await asyncio.sleep(setup.delay)
            victim = await measure_victim(setup, setup.timeout, attack.victim)
            exchanges = await attacking  # bounded by the deadline in its process
        finally:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
    quiet_after = await wait_quiet(setup)
    return CaseResult(
        attack.case,
        attack.description,
        attack.body_bytes,
        exchanges,
        victim,
        live,
        quiet_after,
        attack.sends,
        setup.alone_by_kind.get(attack.victim),
    )


async def keys_required(url: str, model: str) -> int:
    """The status of a small request without a key: 401 when the gateway requires keys, as it should here."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return (await client.post(CHAT, json=body)).status_code


async def metrics_with_load(metrics_url: str) -> bool:
    """Whether this URL serves the executors' load (a gateway may keep /metrics off its public port)."""
    with contextlib.suppress(httpx.HTTPError):
        async with httpx.AsyncClient(timeout=10) as client:
            response = await client.get(metrics_url)
        return response.status_code == 200 and bool(executor_load(response.text))
    return False


async def measure(args: argparse.Namespace, url: str, metrics_url: str, alpha: str, beta: str) -> dict:
    sizes = Sizes(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Sizes)})
    headers = {"authorization": f"Bearer {beta}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=args.timeout) as victim:
        models = await victim.get("/v1/models")
        models.raise_for_status()
        model = models.json()["data"][0]["id"]
        has_load = await metrics_with_load(metrics_url)
        setup = Setup(
            url=url,
            metrics_url=metrics_url if has_load else None,
            alpha_key=alpha,
            victim=victim,
            model=model,
            victim_tokens=args.victim_tokens,
            delay=args.delay,
            timeout=args.timeout,
            settle_timeout=args.timeout if args.settle_timeout is None else args.settle_timeout,
        )
        keyless = await keys_required(url, model)
        if keyless != 401:
            print(
                f"warning: a request without a key got {keyless}, not 401: keys are not required", flush=True
            )
        if not has_load:
            print(
                f"note: {metrics_url} shows no executor load; quiet is judged by the victim alone", flush=True
            )
        chat_alone = await alone(setup, args.reps)
        setup.alone = statistics.median(v.latency for v in chat_alone)
        ttft_alone = statistics.median(v.ttft for v in chat_alone)
        print(
            f"victim alone: {setup.alone:.2f} s (TTFT {ttft_alone:.2f} s), median of {args.reps}", flush=True
        )
        results = []
        for case in args.cases:
            attack = ATTACKS[case](sizes, model)
            if attack.victim != "chat" and attack.victim not in setup.alone_by_kind:
                measured = await alone(setup, args.reps, attack.victim)
                setup.alone_by_kind[attack.victim] = statistics.median(v.latency for v in measured)
                print(
                    f"{attack.victim} victim alone: {setup.alone_by_kind[attack.victim]:.2f} s, "
                    f"median of {args.reps}",
                    flush=True,
                )
            print(f"case {case}: {attack.description} ...", flush=True)
            results.append(await run_case(attack, setup))
    return {
        "url": url,
        "model": model,
        "keyless_status": keyless,
        "victim_tokens": args.victim_tokens,
        "timeout_s": args.timeout,
        "delay_s": args.delay,
        "settle_timeout_s": setup.settle_timeout,
        "alone": [asdict(v) for v in chat_alone],
        "alone_s": setup.alone,
        "alone_ttft_s": ttft_alone,
        "sizes": asdict(sizes),
        "cases": [asdict(r) for r in results],
    }


# --- the command --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.tenancy.hostile_inputs",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--cases", type=parse_cases, default="1,2,3,4,5,6,7,8", help="e.g. 1,3,6 (6: 6a and 6b)"
    )
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds the victim may take per measurement"
    )
    parser.add_argument(
        "--delay", type=float, default=1.0, help="seconds from the attack to the victim's request"
    )
    parser.add_argument(
        "--settle-timeout",
        type=float,
        default=None,
        help="seconds for the stack to be quiet again after each case (None: --timeout)",
    )
    parser.add_argument("--reps", type=int, default=3, help="victim requests alone, for the median")
    parser.add_argument("--victim-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None, help="also write the results here as JSON")
    stack = parser.add_argument_group("the stack (default: one started here)")
    stack.add_argument("--url", default=None, help="a running gateway instead, e.g. http://127.0.0.1:8000")
    stack.add_argument("--alpha-key", default=None, help="with --url: the attacker's API key")
    stack.add_argument("--beta-key", default=None, help="with --url: the victim's API key")
    stack.add_argument(
        "--metrics-url", default=None, help="with --url: its executors' load (None: URL/metrics)"
    )
    stack.add_argument("--model", default=None, help="for the stack started here (None: the default model)")
    stack.add_argument("--up-args", default="", help="more `kvserve up` flags, e.g. limits, as one string")
    stack.add_argument(
        "--log", type=Path, default=Path("bench/results/hostile-inputs-up.log"), help="kvserve up's output"
    )
    sizes = parser.add_argument_group("sizes of the hostile inputs")
    for each in dataclasses.fields(Sizes):
        flag = "--" + each.name.replace("_", "-")
        if isinstance(each.default, bool):
            sizes.add_argument(flag, action="store_true", help=each.metadata["help"])
        else:
            sizes.add_argument(
                flag, type=type(each.default), default=each.default, help=each.metadata["help"]
            )
    return parser


def _stop_on_sigterm(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through the stack's cleanup, as Ctrl-C does


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.url is not None and not (args.alpha_key and args.beta_key):
        parser.error("--url needs --alpha-key and --beta-key")
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        if args.url is not None:
            url = args.url.rstrip("/")
            report = asyncio.run(
                measure(args, url, args.metrics_url or f"{url}/metrics", args.alpha_key, args.beta_key)
            )
        else:
            with tenant_stack(["alpha", "beta"], args.log, args.model, shlex.split(args.up_args)) as stack:
                print(f"kvserve up at {stack.url} (log: {stack.log_path})", flush=True)
                report = asyncio.run(
                    measure(args, stack.url, stack.metrics_url, stack.keys["alpha"], stack.keys["beta"])
                )
    except KeyboardInterrupt:
        print("interrupted; everything started here is stopped", file=sys.stderr)
        return 130
    print()
    print(markdown_table(report))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
