"""What the server itself measured during a run: the gateway's added latency, from its Prometheus histogram.

The client cannot see how much of its time to first token the gateway spent (tokenizing, routing, relaying) and
how much the executor did; kvserve's gateway records the difference per request. Scraping /metrics before and
after the run and subtracting isolates this run's requests, from any number of earlier ones.
"""

from __future__ import annotations

import math

import httpx
from prometheus_client.parser import text_string_to_metric_families

ADDED_LATENCY = "kvserve_gateway_added_latency_seconds"

Buckets = dict[float, float]  # upper bound `le` -> cumulative count


async def scrape_histogram(url: str, name: str = ADDED_LATENCY, timeout: float = 10.0) -> Buckets | None:
    """The histogram's cumulative buckets from url/metrics; None when the server does not expose it."""
    try:
        async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
            response = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return histogram_buckets(response.text, name)


def histogram_buckets(text: str, name: str) -> Buckets | None:
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:  # not Prometheus text: some other server's /metrics page
        return None
    for family in families:
        if family.name == name.removesuffix("_seconds") or family.name == name:
            buckets = {
                float(sample.labels["le"]): sample.value
                for sample in family.samples
                if sample.name == f"{name}_bucket"
            }
            return buckets or None
    return None


def bucket_difference(after: Buckets, before: Buckets | None) -> Buckets:
    return {le: count - (before or {}).get(le, 0.0) for le, count in after.items()}


def histogram_quantile(q: float, buckets: Buckets) -> float | None:
    """Prometheus's histogram_quantile: linear interpolation inside the bucket holding the q-th observation."""
    if not 0 <= q <= 1:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    ordered = sorted(buckets.items())
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for upper_bound, count in ordered:
        if count >= rank:
            if math.isinf(upper_bound):
                return lower_bound  # beyond the largest finite bucket: its bound is all that is known
            if count == lower_count:
                return upper_bound
            return lower_bound + (upper_bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = upper_bound, count
    return ordered[-1][0]


def added_latency_summary(after: Buckets | None, before: Buckets | None) -> dict | None:
    """Count, p50 and p90 in ms of this run's gateway-added latency; None when the server has no such metric."""
    if after is None:
        return None
    run = bucket_difference(after, before)
    count = max(run.values(), default=0.0)
    if count <= 0:
        return None
    return {
        "count": int(count),
        "p50_ms": histogram_quantile(0.5, run) * 1000,
        "p90_ms": histogram_quantile(0.9, run) * 1000,
        # the share of requests whose added latency stayed within 5 ms (a bucket bound, so exact)
        "share_within_5ms": run.get(0.005, 0.0) / count,
    }
