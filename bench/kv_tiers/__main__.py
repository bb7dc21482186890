"""The KV tiers side by side in one run (issue 48): each part against its baseline, one markdown table, JSON.

(a) Multi-turn Responses API conversations (--users x --turns; a document first, then messages chained by
    previous_response_id) through a KV pool --pool-fraction of their working set, without a KV tier and with a
    host tier holding all of it: cached share (usage over every turn) and TTFT p50/p90 (bench/kv_tiers/
    conversations.py). Targets: cached share >= 0.8, TTFT p90 at least 3x better with the tier.
(b) A prefix pulled from a peer executor against computing it, at --prefix-tokens lengths: TTFT medians of
    --repeats tries (bench/kv_tiers/pulls.py). Target: pull <= 0.25x recompute at 2,048 tokens.
(c) A restart from the disk tier: distinct prompts, the stack stopped and started again on the same
    --kv-offload-dir, the prompts again: cached share of those revisits (bench/kv_tiers/restart.py). Target: >= 0.9.

Sizes follow the model's config.json (bench/kv_tiers/workload.py). Every stack is `kvserve up` on the CPU in
float32 with a Redis of its own, or for (b) two `kvserve executor`s; their logs go to --log-dir.

    python -m bench.kv_tiers [--part a|b|c|all] [--out bench/results/kv_tiers.json]
    python -m bench.kv_tiers --part a --users 2 --turns 2 --document-tokens 200   # a smoke run
    python -m bench.kv_tiers --part a --runs "host tier,host tier (reuse)"   # admission rules
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
from pathlib import Path

from bench.kv_tiers import conversations, pulls, restart
from bench.kv_tiers.workload import (
    ConversationShape,
    kv_bytes_per_token,
    markdown_table,
    model_config,
    tier_sizes,
)

PARTS = ("a", "b", "c")
PULL_POOL_PROMPTS = 4  # (b)'s pools hold this many of its longest prompts: a load may pin at most half a pool
PULL_HOST_TIER_BYTES = 256 * 2**20  # (b)'s executors serve pulls from a pool and a small host tier
DISK_TIER_MARGIN = 3  # (c)'s disk tier: room for the answers' blocks and words that take two tokens


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.kv_tiers",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--part", choices=[*PARTS, "all"], default="all")
    a = parser.add_argument_group("(a) conversations")
    a.add_argument("--users", type=int, default=32)
    a.add_argument("--turns", type=int, default=8)
    a.add_argument("--document-tokens", type=int, default=1000, help="each user's first-turn document")
    a.add_argument("--message-tokens", type=int, default=125, help="each later turn's message")
    a.add_argument("--max-output-tokens", type=int, default=32)
    a.add_argument("--concurrency", type=int, default=1, help="requests at a time (1: TTFT is the prefill's)")
    a.add_argument(
        "--runs",
        default=",".join(conversations.RUNS),
        help=f"comma-separated, of: {', '.join(conversations.ALL_RUNS)} (the last: the host tier under "
        "--kv-offload-admission reuse, compared with the host tier's default, recency)",
    )
    a.add_argument(
        "--pool-fraction", type=float, default=0.125, help="the KV pool's share of the working set"
    )
    b = parser.add_argument_group("(b) pull against recompute")
    b.add_argument("--prefix-tokens", default="512,2048,8192", help="lengths, comma-separated")
    b.add_argument("--repeats", type=int, default=3, help="tries per length; medians reported")
    b.add_argument("--executor-args", default="", help="more `kvserve executor` flags, as one string")
    c = parser.add_argument_group("(c) restart from the disk tier")
    c.add_argument("--restart-prompts", type=int, default=20)
    c.add_argument("--restart-prompt-tokens", type=int, default=1000)
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument(
        "--up-args", default="", help="more `kvserve up` flags for (a) and (c), as one string"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", type=Path, default=Path("bench/results"), help="the stacks' output")
    parser.add_argument("--out", type=Path, default=Path("bench/results/kv_tiers.json"))
    return parser


def run_part(part: str, args: argparse.Namespace, config: dict, bytes_per_token: int) -> tuple[dict, list]:
    up_args = shlex.split(args.up_args)
    if part == "a":
        shape = ConversationShape(
            args.users, args.turns, args.document_tokens, args.message_tokens, args.max_output_tokens
        )
        sizes = tier_sizes(shape, bytes_per_token, args.pool_fraction)
        runs = tuple(name.strip() for name in args.runs.split(","))
        if unknown := set(runs) - set(conversations.ALL_RUNS):
            raise SystemExit(
                f"--runs: unknown {', '.join(sorted(unknown))}; known: {', '.join(conversations.ALL_RUNS)}"
            )
        report = conversations.measure(
            shape,
            sizes,
            bytes_per_token,
            args.concurrency,
            args.seed,
            args.model,
            up_args,
            args.log_dir,
            runs,
        )
        return report, conversations.rows(report)
    if part == "b":
        lengths = [int(n) for n in args.prefix_tokens.split(",")]
        max_len = config["max_position_embeddings"]
        pool = PULL_POOL_PROMPTS * min(max(lengths), max_len) * bytes_per_token
        flags = ["--kv-cache-memory", str(pool), "--kv-offload-memory", str(PULL_HOST_TIER_BYTES)]
        flags += shlex.split(args.executor_args)
        report = pulls.measure(
            lengths, args.repeats, config["vocab_size"], max_len, args.model, flags, args.log_dir, args.seed
        )
        return report, pulls.rows(report, args.repeats)
    disk = args.restart_prompts * args.restart_prompt_tokens * bytes_per_token * DISK_TIER_MARGIN
    report = restart.measure(
        args.restart_prompts,
        args.restart_prompt_tokens,
        args.seed,
        args.model,
        ["--kv-offload-disk", str(disk), *up_args],
        args.log_dir,
    )
    return report, restart.rows(report)


def _stop_on_sigterm(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through the stacks' cleanup, as Ctrl-C does


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    config = model_config(args.model)
    bytes_per_token = kv_bytes_per_token(config)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "kv_bytes_per_token": bytes_per_token,
    }
    rows = []
    for part in PARTS if args.part == "all" else (args.part,):
        results[part], part_rows = run_part(part, args, config, bytes_per_token)
        rows += part_rows
        results["table"] = markdown_table(rows)
        args.out.write_text(json.dumps(results, indent=1))  # each part kept as soon as it is measured
        print(markdown_table(part_rows), flush=True)
    print()
    print(results["table"])
    print(f"\nresults: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
