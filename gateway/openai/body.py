"""A request's body: read only once its caller is known, within a size limit (413) and a deadline (408), so a
client that sends slowly, or too much, holds the gateway neither long nor much; then checked to be one JSON object
(415, 400) whose strings are valid Unicode and whose nesting is shallow, which every later check may assume."""

from __future__ import annotations

import asyncio
import json

from starlette.requests import Request

from gateway.api_error import APIError, invalid_request

MAX_BODY_BYTES = 4 * 1024 * 1024  # larger bodies get 413 before any parsing
MAX_JSON_DEPTH = 64  # levels of arrays and objects; OpenAI's own bodies need a handful

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


def body_too_large(size: str) -> APIError:
    return APIError(413, f"request body is {size}; the limit is {MAX_BODY_BYTES}", code="request_too_large")


def check_content_type(content_type: str | None) -> None:
    """JSON bodies only, as vLLM (415): a form or text body is a client's mistake, not JSON by luck. The media type
    is compared case-insensitively, parameters (charset) aside; no Content-Type at all is read as JSON, which
    HTTP allows (RFC 9110 8.3: the recipient may examine the data) and raw clients rely on."""
    if content_type is None:
        return
    if content_type.split(";", 1)[0].strip().lower() != "application/json":
        raise APIError(
            415,
            f"Content-Type must be application/json, got {content_type!r}",
            code="unsupported_media_type",
        )


def read_json_body(raw: bytes) -> dict:
    """Size first (413), then UTF-8 and JSON (400), then shape: every later check may assume a dict whose strings
    are valid Unicode and whose nesting is shallow."""
    if len(raw) > MAX_BODY_BYTES:
        raise body_too_large(f"{len(raw)} bytes")
    try:
        text = raw.decode("utf-8")  # strict: also refuses UTF-8-encoded surrogates (\xed\xa0\x80)
    except UnicodeDecodeError as exc:
        raise invalid_request(
            f"request body is not valid JSON: it must be UTF-8, and byte {exc.start} is not ({exc.reason})",
            None,
        ) from None
    try:
        body = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:  # the C decoder's own guard, near a thousand levels
        raise invalid_request(f"request body is nested deeper than {MAX_JSON_DEPTH} levels", None) from None
    except json.JSONDecodeError as exc:
        raise invalid_request(f"request body is not valid JSON: {exc}", None) from None
    except ValueError as exc:  # an integer of more than 4,300 digits
        raise invalid_request(f"request body holds a number too long to read: {exc}", None) from None
    if not isinstance(body, dict):
        raise invalid_request("request body must be a JSON object", None)
    _check_values(body)
    return body


def _refuse_constant(name: str) -> float:
    """Python's json reads NaN and Infinity, which JSON does not have."""
    raise json.JSONDecodeError(f"{name} is not a JSON value", name, 0)


def _check_values(body: dict) -> None:
    """Bounded nesting, so later code may recurse (repr, msgpack); and strings that UTF-8 can carry: a JSON escape
    can spell a lone surrogate ("\\ud800"), which the tokenizer, msgpack and our own JSON replies all refuse."""
    pending: list[tuple[dict | list, tuple]] = [(body, ())]
    while pending:
        value, path = pending.pop()
        if len(path) >= MAX_JSON_DEPTH:
            field = _param(path[:1])
            raise invalid_request(f"{field} is nested deeper than {MAX_JSON_DEPTH} levels", field)
        if isinstance(value, list) and all(type(item) is int for item in value):
            continue  # token ids, the one long list a body has: ~10x faster than the loop below
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            if isinstance(key, str) and _not_unicode(key):
                where = _param(path) or "the request body"
                raise invalid_request(
                    f"a key in {where} is not valid Unicode (a lone surrogate)", _param(path)
                )
            if isinstance(item, str) and _not_unicode(item):
                param = _param((*path, key))
                raise invalid_request(f"{param} is not valid Unicode: it holds a lone surrogate", param)
            if isinstance(item, (dict, list)):
                pending.append((item, (*path, key)))


def _not_unicode(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _param(path: tuple) -> str | None:
    """("messages", 0, "content") -> "messages[0].content", as the other checks name fields."""
    name = ""
    for part in path:
        name += f"[{part}]" if isinstance(part, int) else f".{part}" if name else part
    return name or None


def typed_field(body: dict, name: str, kind: type, what: str, default=None):
    """One optional field of a JSON type; null means absent, as OpenAI treats it. A bool is never an int here."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise invalid_request(f"{name} must be {what}, got {value!r}", name)
    return value
