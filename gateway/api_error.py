"""The one error type the gateway answers with, in OpenAI's shape, so clients' SDKs raise the right exception."""

from __future__ import annotations

from starlette.responses import JSONResponse

from gateway.openai.sse import sse_data

EXECUTOR_HEADER = "x-kvserve-executor"
REQUEST_ID_HEADER = "x-request-id"  # the id the gateway's and executor's log lines carry
NO_EXECUTOR = "none"  # the executor header's value when a request was answered before reaching one
# messages may quote the client's input (a field's value), which can be megabytes: the reply quotes a bounded part
MAX_MESSAGE_CHARS = 1000


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
        if len(message) > MAX_MESSAGE_CHARS:
            cut = f"... ({len(message)} characters)"
            message = message[: MAX_MESSAGE_CHARS - len(cut)] + cut
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
        return sse_data(self.body())


def invalid_request(message: str, param: str | None) -> APIError:
    """400 naming the offending field: the common case, written once."""
    return APIError(400, message, "invalid_request_error", param)


def internal_error(request_id: str) -> APIError:
    """A fault of ours, not the client's: a 500 that points at the log line holding the traceback."""
    where = f" (request id {request_id})" if request_id else ""
    return APIError(500, f"internal error: the gateway's log has the details{where}", "server_error")


def error_response(error: APIError, request_id: str, executor_id: str = NO_EXECUTOR) -> JSONResponse:
    headers = {**error.headers, EXECUTOR_HEADER: executor_id}
    if request_id:
        headers[REQUEST_ID_HEADER] = request_id
    return JSONResponse(error.body(), status_code=error.status, headers=headers)
