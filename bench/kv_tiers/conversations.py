"""Part (a): multi-turn Responses API conversations through a pool an eighth of their working set, without a KV
tier and with a host tier that holds it all.

Each user's first turn is a document and a question; each later turn a message of its own chained by
previous_response_id (stored responses), so each prompt is the user's whole history. Users take turns round
robin, --concurrency requests at a time (1: TTFT is the prefill's alone). Between two visits of one user every
other user's history passes through the pool, which keeps none of it: without a tier every turn is prefilled
whole; with one, the history comes back from the tier.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from bench.kv_tiers.workload import Conversations, ConversationShape, Row, TierSizes, ms, ratio, share
from bench.metrics import RequestResult, distribution_ms
from bench.serving.responses_conversation import turn
from bench.tenancy.noisy_neighbour import cached_share
from bench.tenancy.tenant_stack import tenant_stack

TENANT = "kv-tiers"
INSTRUCTIONS = "You are a careful reader. Answer in two or three plain sentences."
RUNS = ("no tier", "host tier")  # the default runs, the table's two columns
# the host tier with --kv-offload-admission reuse (a block goes down on its second use): against "host tier"
# (recency), what gating admission costs conversations
REUSE_RUN = "host tier (reuse)"
ALL_RUNS = (*RUNS, REUSE_RUN)


def run_conversations(
    url: str, key: str, conversations: Conversations, concurrency: int
) -> list[RequestResult]:
    """Every turn of every user, round by round; a request's result carries its usage and its TTFT (the first
    output text delta, streamed)."""
    shape = conversations.shape
    previous: list[str | None] = [None] * shape.users
    results: list[RequestResult] = []

    def one(user: int, k: int) -> RequestResult:
        body = {
            "instructions": INSTRUCTIONS,
            "input": conversations.input(user, k),
            "max_output_tokens": shape.max_output_tokens,
            "temperature": 0,
            "stream": True,
            "store": True,
        }
        if previous[user] is not None:
            body["previous_response_id"] = previous[user]
        served = turn(url, key, body)
        previous[user] = served["response"]["id"]
        usage = served["response"]["usage"]
        return RequestResult(
            index=k * shape.users + user,
            chunk_times=[served["ttft_s"]],
            output_tokens=usage["output_tokens"],
            prompt_tokens=usage["input_tokens"],
            cached_tokens=usage["input_tokens_details"]["cached_tokens"],
            executor=served["executor"],
        )

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for k in range(shape.turns):
            results += pool.map(lambda user, k=k: one(user, k), range(shape.users))
    return results


def summary(results: list[RequestResult], bytes_per_token: int, users: int) -> dict:
    ttft = distribution_ms([r.ttft for r in results if r.ttft is not None])
    # a user's first turn is a document no run has seen: cold with a tier or without, and 1 in --turns of all
    # requests (at 8 turns, more than the slowest tenth), so the revisits' TTFT is reported on its own too
    revisits = distribution_ms([r.ttft for r in results[users:] if r.ttft is not None])
    last = results[-users:]  # each user's last turn: its whole history
    return {
        "requests": len(results),
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in results),
        "cached_tokens": sum(r.cached_tokens or 0 for r in results),
        "cached_share": cached_share(results),
        "ttft_ms": ttft,
        "revisit_ttft_ms": revisits,
        "measured_working_set_bytes": sum((r.prompt_tokens or 0) + r.output_tokens for r in last)
        * bytes_per_token,
        "turns": [r.to_json() for r in results],
    }


def measure(
    shape: ConversationShape,
    sizes: TierSizes,
    bytes_per_token: int,
    concurrency: int,
    seed: int,
    model: str | None,
    up_args: list[str],
    log_dir: Path,
    runs: tuple[str, ...] = RUNS,
) -> dict:
    """The runs, each on a stack of its own, one after the other."""
    conversations = Conversations(shape, seed)
    report = {
        "shape": asdict(shape),
        "working_set_bytes": sizes.working_set,
        "pool_bytes": sizes.pool,
        "pool_floored": sizes.pool_floored,
        "host_tier_bytes": sizes.host,
        "runs": {},
    }
    for name in runs:
        extra = ["--kv-cache-memory", str(sizes.pool)]
        if name != "no tier":
            extra += ["--kv-offload-memory", str(sizes.host)]
        if name == REUSE_RUN:
            extra += ["--kv-offload-admission", "reuse"]
        log = (
            log_dir / f"kv_tiers_conversations_{name.replace('(', '').replace(')', '').replace(' ', '_')}.log"
        )
        print(
            f"(a) {name}: {shape.users} users x {shape.turns} turns, kvserve up {' '.join(extra)}", flush=True
        )
        with tenant_stack([TENANT], log, model, [*extra, *up_args]) as stack:
            key = stack.keys[TENANT]
            turn(stack.url, key, {"input": "Hello.", "max_output_tokens": 4, "store": False, "stream": True})
            results = run_conversations(stack.url, key, conversations, concurrency)
        report["runs"][name] = summary(results, bytes_per_token, shape.users)
    return report


def rows(report: dict) -> list[Row]:
    runs = report["runs"]
    out = tier_rows(runs["no tier"], runs["host tier"]) if all(name in runs for name in RUNS) else []
    if "host tier" in runs and REUSE_RUN in runs:
        out += admission_rows(runs["host tier"], runs[REUSE_RUN])
    return out


def admission_rows(recency: dict, reuse: dict) -> list[Row]:
    """Recency admission (the host tier's default) in the first column, reuse-gated in the second."""
    out = [
        Row(
            "(a) admission",
            "cached share, recency vs reuse",
            share(recency["cached_share"]),
            share(reuse["cached_share"]),
        )
    ]
    for p in ("p50", "p90"):
        slow, fast = reuse["revisit_ttft_ms"][p], recency["revisit_ttft_ms"][p]
        better = ratio(slow, fast)
        out.append(
            Row(
                "(a) admission",
                f"TTFT {p} revisits, recency vs reuse",
                ms(fast and fast / 1000),
                ms(slow and slow / 1000),
                "-" if better is None else f"recency {better:.2f}x better",
            )
        )
    return out


def tier_rows(without: dict, with_tier: dict) -> list[Row]:
    shares = (without["cached_share"], with_tier["cached_share"])
    out = [
        Row(
            "(a)",
            "cached share, all turns",
            share(shares[0]),
            share(shares[1]),
            target=">= 0.8",
            met=None if shares[1] is None else shares[1] >= 0.8,
        )
    ]
    for turns, key in (("all turns", "ttft_ms"), ("revisits (turns 2+)", "revisit_ttft_ms")):
        for p in ("p50", "p90"):
            slow, fast = without[key][p], with_tier[key][p]
            better = ratio(slow, fast)
            out.append(
                Row(
                    "(a)",
                    f"TTFT {p}, {turns}",
                    ms(slow and slow / 1000),
                    ms(fast and fast / 1000),
                    "-" if better is None else f"{better:.2f}x better",
                    ">= 3x better" if p == "p90" else "",
                    None if p != "p90" or better is None else better >= 3,
                )
            )
    return out
