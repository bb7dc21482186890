"""What one benchmark run measured, reduced to the numbers vLLM's benchmark_serving and GuideLLM report.

TTFT: request sent -> first chunk carrying content. ITL: the gaps between successive content chunks, pooled over
all requests. TPOT: (e2e - ttft) / (output_tokens - 1), per request. E2E: request sent -> stream finished.
Failed requests count as errors and are left out of every latency and throughput figure, as vLLM does.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)
MAX_ERROR_MESSAGES = 5


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it; times in seconds, chunk times relative to the request's send."""

    index: int
    start: float = 0.0  # seconds since the run began
    e2e: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk carrying content
    output_tokens: int = 0  # usage.completion_tokens, else the number of content chunks
    prompt_tokens: int | None = None  # None: the server sent no usage
    cached_tokens: int | None = None  # None: the server does not report prefix-cache hits
    executor: str | None = None  # the x-kvserve-executor header, when the server sends it
    request_id: str | None = None  # the x-request-id header: the id in the server's log lines
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        """Undefined for a request with one output token or no content at all."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict:
        return {
            "index": self.index,
            "start_s": self.start,
            "ttft_s": self.ttft,
            "e2e_s": self.e2e if self.ok else None,
            "tpot_s": self.tpot,
            "itl_s": self.itl,
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "executor": self.executor,
            "request_id": self.request_id,
            "error": self.error,
        }


def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks, numpy.percentile's default (what vLLM reports)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 in milliseconds; all None when nothing was measured."""
    if not values_s:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    values = [v * 1000 for v in values_s]
    return {"mean": sum(values) / len(values), **{f"p{p}": percentile(values, p) for p in PERCENTILES}}


def summarize(results: Sequence[RequestResult], duration: float) -> dict:
    """The run's headline numbers; `duration` is wall time from the first send to the last response."""
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    with_cache = [r for r in done if r.cached_tokens is not None and r.prompt_tokens]
    cached_prompt = sum(r.prompt_tokens or 0 for r in with_cache)
    executors = Counter(r.executor for r in done if r.executor is not None)
    return {
        "duration_s": duration,
        "completed": len(done),
        "failed": len(failed),
        "requests_per_s": len(done) / duration if duration > 0 else None,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / duration if duration > 0 else None,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in done),
        # None when the server reports no cached_tokens at all (vLLM without --enable-prompt-tokens-details)
        "cached_tokens": sum(r.cached_tokens or 0 for r in with_cache) if with_cache else None,
        "cached_token_share": (
            sum(r.cached_tokens or 0 for r in with_cache) / cached_prompt if cached_prompt else None
        ),
        "ttft_ms": distribution_ms([r.ttft for r in done if r.ttft is not None]),
        "itl_ms": distribution_ms([gap for r in done for gap in r.itl]),
        "tpot_ms": distribution_ms([r.tpot for r in done if r.tpot is not None]),
        "e2e_ms": distribution_ms([r.e2e for r in done]),
        "executors": dict(sorted(executors.items())),
        "errors": {
            "count": len(failed),
            "messages": [r.error for r in failed[:MAX_ERROR_MESSAGES]],
        },
    }


def format_summary(summary: dict) -> str:
    """A few lines for people; the JSON output has everything."""

    def ms(name: str) -> str:
        d = summary[f"{name}_ms"]
        if d["mean"] is None:
            return f"{name.upper():5} -"
        return f"{name.upper():5} mean {d['mean']:8.1f}  p50 {d['p50']:8.1f}  p90 {d['p90']:8.1f}  p99 {d['p99']:8.1f} ms"

    def rate(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    share = summary["cached_token_share"]
    lines = [
        f"requests    {summary['completed']} ok, {summary['failed']} failed in {summary['duration_s']:.2f} s "
        f"({rate(summary['requests_per_s'])} req/s)",
        f"output      {summary['output_tokens']} tokens ({rate(summary['output_tokens_per_s'])} tok/s)",
        f"prompt      {summary['prompt_tokens']} tokens, cached share "
        + ("not reported" if share is None else f"{share:.1%}"),
        ms("ttft"),
        ms("itl"),
        ms("tpot"),
        ms("e2e"),
    ]
    added = summary.get("gateway_added_latency")
    if added:
        lines.append(
            f"gateway     added latency p50 {added['p50_ms']:.2f} ms, p90 {added['p90_ms']:.2f} ms, "
            f"{added['share_within_5ms']:.1%} of {added['count']} requests within 5 ms (server histogram)"
        )
    if summary["executors"]:
        lines.append("executors   " + ", ".join(f"{k}: {v}" for k, v in summary["executors"].items()))
    for message in summary["errors"]["messages"]:
        lines.append(f"error       {message}")
    return "\n".join(lines)
