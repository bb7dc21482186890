"""Where a request's cached prompt tokens came from (issue 48): the executor's pool, a KV tier below it that loaded
them into the pool before the request started (host memory, disk), or a peer executor they were pulled from.

One split, made here, serves the executor's request log line and spans, the wire (shared.protocol.RequestUpdate's
cached_from) and the tenant's usage, so they agree with each other and always sum to the request's cached tokens.
"""

from __future__ import annotations

from collections.abc import Mapping

SOURCES = ("pool", "host", "disk", "peer")
# what was loaded into the pool, as the executor's Request.cached_from and the wire name it; the pool's share is
# what these leave of the cached tokens, so it is never sent
LOADED_SOURCES = SOURCES[1:]


def loaded_tokens(num_cached_tokens: int, cached_from: Mapping[str, int]) -> dict[str, int]:
    """The nonzero loads among num_cached_tokens. A load the scheduler did not count as cached (its pins were let
    go and its blocks evicted before the request started) is cut, the chain's last first: a peer's pulls come
    after the tiers' loads, which come after the pool's hits."""
    if not cached_from:
        return {}
    left = max(0, num_cached_tokens)
    loaded = {}
    for source in LOADED_SOURCES:
        tokens = min(cached_from.get(source, 0), left)
        if tokens > 0:
            loaded[source] = tokens
            left -= tokens
    return loaded


def by_source(num_cached_tokens: int, cached_from: Mapping[str, int]) -> dict[str, int]:
    """Every source's cached tokens, all four in SOURCES' order, summing to num_cached_tokens (-1, not yet
    scheduled, counts as 0)."""
    loaded = loaded_tokens(num_cached_tokens, cached_from)
    pool = max(0, num_cached_tokens) - sum(loaded.values())
    return {"pool": pool, **{source: loaded.get(source, 0) for source in LOADED_SOURCES}}


def is_loaded_tokens(value: object, num_cached_tokens: int) -> bool:
    """What a RequestUpdate's cached_from may be on the wire: nil, or a map of LOADED_SOURCES to integers >= 0
    that sum to at most the update's num_cached_tokens (so the pool's share is never negative)."""
    if value is None:
        return True
    return (
        isinstance(value, dict)
        and all(
            source in LOADED_SOURCES
            and isinstance(tokens, int)
            and not isinstance(tokens, bool)
            and tokens >= 0
            for source, tokens in value.items()
        )
        and sum(value.values()) <= max(0, num_cached_tokens)
    )
