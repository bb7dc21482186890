"""The one error type the gateway answers with, in OpenAI's shape, so clients' SDKs raise the right exception."""

from __future__ import annotations

import json


class APIError(Exception):
    """A request that cannot be served: its HTTP status and OpenAI's error body (message, type, param, code)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers or {}  # e.g. retry-after on a 429
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        """OpenAI's `{"error": {...}}` object, always with all four keys, as its SDKs expect."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def sse_event(self) -> str:
        """A mid-stream failure: once headers are sent the status cannot change, so the error rides an event."""
        return f"data: {json.dumps(self.body(), separators=(',', ':'), ensure_ascii=False)}\n\n"


def invalid_request(message: str, param: str | None) -> APIError:
    """400 naming the offending field: the common case, written once."""
    return APIError(400, message, "invalid_request_error", param)
