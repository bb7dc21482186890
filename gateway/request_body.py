"""A request's body, read only once its caller is known: within a size limit (413) and a deadline (408), so a
client that sends slowly, or too much, holds the gateway neither long nor much."""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from gateway.api_error import APIError
from gateway.openai_protocol import MAX_BODY_BYTES, body_too_large

# a 4 MiB body (the limit) needs about 1.1 Mbit/s to arrive in time; nginx gives 60 s between two reads
BODY_TIMEOUT_S = 30.0


def body_timed_out(timeout_s: float) -> APIError:
    """408 on a connection that then closes (RFC 9110 15.5.9): the rest of a slow body is not waited for."""
    return APIError(
        408,
        f"the request body did not arrive within {timeout_s:g} s",
        code="request_timeout",
        headers={"connection": "close"},
    )


async def read_body(request: Request, timeout_s: float) -> bytes:
    """The whole body, or 408 once timeout_s (wall clock) has passed; ClientDisconnect if the client leaves."""
    try:
        async with asyncio.timeout(timeout_s):
            return await _limited(request)
    except TimeoutError:
        raise body_timed_out(timeout_s) from None


async def _limited(request: Request) -> bytes:
    """Refused (413) as soon as it outgrows the limit: a chunked upload declares no length to check up front."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise body_too_large(f"{length} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise body_too_large(f"more than {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
