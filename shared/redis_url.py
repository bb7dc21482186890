"""Redis URLs carry the password (`redis://:PASSWORD@host:6379/0`, `rediss://` for TLS). Every client is made from
the whole URL, so redis-py keeps the password and TLS from it; only `masked(url)` reaches a log line or a message.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import redis

MASK = "***"


def masked(url: str) -> str:
    """The URL with its password (if any) replaced by ***: what log lines and error messages may show."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:{MASK}@{host}"))


def describe_error(url: str, error: redis.RedisError) -> str:
    """One line for a Redis failure at start-up, naming what to fix and never the password."""
    where = masked(url)
    # a missing or wrong password will not fix itself by retrying (redis-py makes it a ConnectionError)
    if isinstance(error, redis.AuthenticationError):
        if urlsplit(url).password is None:
            return (
                f"Redis at {where} requires a password and the URL has none: "
                "give it as redis://:PASSWORD@HOST:PORT/DB (or rediss:// for TLS)"
            )
        return f"Redis at {where} refused the URL's password: {error}"
    return f"cannot reach Redis at {where}: {error}"
