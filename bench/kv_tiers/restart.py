"""Part (c): a restart from the disk tier. A stack with --kv-offload-dir (a directory of this run's own) serves
distinct prompts once; once their blocks are on disk it stops (the drain `kvserve up` does on a signal), a new
stack starts on the same directory, and the same prompts come again: the share of their prompt tokens that the
new executor did not compute, from usage.prompt_tokens_details.cached_tokens.

Redis stays up across the restart, as a deployment's does and as `kvserve up`'s embedded one keeps its data: it
holds the tenant's cache salt, from which the prompts' block hashes start. What else it held of the executor
goes when the executor stops (it deregisters), and the new executor's pool starts empty, so every cached token
of a revisit came from the disk tier.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path

import httpx

from bench.kv_tiers.workload import Row, distinct_prompts, ms, share
from bench.load import LoadConfig, auth_headers, first_model, request_body
from bench.metrics import RequestResult, distribution_ms
from bench.stream import stream_request
from bench.tenancy.noisy_neighbour import cached_share
from bench.tenancy.tenant_stack import tenant_stack
from kvserve.redis_server import start_redis_server

TENANT = "kv-tiers"
MAX_TOKENS = 4
BLOCK_FILES = "*.kvb"  # the disk tier's files (executor/kv/tiers/block_files.py), under DIR/<executor id>
SETTLED_S = 2.0  # no new block file for this long: the write-through copies are done
SETTLE_TIMEOUT_S = 120.0
TARGET = 0.9


async def visit(url: str, key: str, prompts: list[str]) -> list[RequestResult]:
    """Each prompt once, one after another, streamed."""
    model = await first_model(url, key)
    async with httpx.AsyncClient(base_url=url, headers=auth_headers(key), timeout=600) as client:
        results = []
        for i, prompt in enumerate(prompts):
            body = request_body(LoadConfig(url, model, "completions", max_tokens=MAX_TOKENS), prompt)
            result = await stream_request(client, "/v1/completions", body, i, time.perf_counter())
            if result.error is not None:
                raise RuntimeError(f"prompt {i}: {result.error}")
            results.append(result)
    return results


def wait_for_block_files(directory: Path) -> int:
    """How many block files the disk tier holds once no new one has come for SETTLED_S."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    count, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        now = len(list(directory.rglob(BLOCK_FILES)))  # a folder per executor
        if now != count:
            count, since = now, time.monotonic()
        elif time.monotonic() - since >= SETTLED_S:
            break
        time.sleep(0.2)
    return count


def measure(count: int, tokens: int, seed: int, model: str | None, up_args: list[str], log_dir: Path) -> dict:
    prompts = distinct_prompts(count, tokens, seed)
    scratch = Path(tempfile.mkdtemp(prefix="kvserve-bench-disk-tier-"))
    directory = scratch / "kv"
    extra = ["--kv-offload-dir", str(directory), *up_args]
    server = start_redis_server()
    try:
        print(
            f"(c) first visits: {count} prompts of ~{tokens} tokens, kvserve up {' '.join(extra)}", flush=True
        )
        log = log_dir / "kv_tiers_restart_first.log"
        with tenant_stack([TENANT], log, model, extra, server.url) as stack:
            first = asyncio.run(visit(stack.url, stack.keys[TENANT], prompts))
            files = wait_for_block_files(directory)
        print(f"(c) stopped with {files} block files on disk; starting again on them", flush=True)
        log = log_dir / "kv_tiers_restart_again.log"
        with tenant_stack([TENANT], log, model, extra, server.url) as stack:
            again = asyncio.run(visit(stack.url, stack.keys[TENANT], prompts))
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "prompts": count,
        "prompt_tokens": tokens,
        "block_files": files,
        "first": _summary(first),
        "after_restart": _summary(again),
    }


def _summary(results: list[RequestResult]) -> dict:
    return {
        "cached_share": cached_share(results),
        "ttft_ms": distribution_ms([r.ttft for r in results if r.ttft is not None]),
        "requests": [r.to_json() for r in results],
    }


def rows(report: dict) -> list[Row]:
    first, again = report["first"], report["after_restart"]
    revisit = again["cached_share"]
    p50 = (first["ttft_ms"]["p50"], again["ttft_ms"]["p50"])
    return [
        Row(
            "(c)",
            f"cached share, first {report['prompts']} revisits after a restart (baseline: first visits)",
            share(first["cached_share"]),
            share(revisit),
            target=f">= {TARGET}",
            met=None if revisit is None else revisit >= TARGET,
        ),
        Row(
            "(c)",
            "TTFT p50, first visits / revisits after the restart",
            ms(p50[0] and p50[0] / 1000),
            ms(p50[1] and p50[1] / 1000),
        ),
    ]
