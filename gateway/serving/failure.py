"""What the client is told of a request that failed, and what its end records of it."""

from __future__ import annotations

import logging

from gateway.api_error import APIError, internal_error
from gateway.routing.executor_client import ExecutorRequestError
from gateway.routing.in_flight import InFlight

log = logging.getLogger("kvserve.gateway")


def as_api_error(caught: Exception, request_id: str) -> APIError:
    """The error as it stands, the executor's in OpenAI's shape, or, for a fault of ours, a 500 whose traceback
    goes to the log."""
    if isinstance(caught, APIError):
        return caught
    if isinstance(caught, ExecutorRequestError):
        kind = "invalid_request_error" if caught.code < 500 else "server_error"
        return APIError(caught.code, str(caught), kind)
    log.error("request failed unexpectedly", exc_info=caught)
    return internal_error(request_id)


def failed(flight: InFlight, error: APIError) -> None:
    """A request that reached an executor failed: its metrics and span report the error at its end."""
    flight.status, flight.error = error.status, error.message
    log.warning("request failed (%d): %s", error.status, error.message)
