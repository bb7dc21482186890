"""The guard around the gateway's routes, on a real uvicorn server: a route that raises answers a JSON 500 in
OpenAI's shape, logged with its traceback and counted, and the connection goes on serving."""

from __future__ import annotations

import json
import logging
import threading

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from gateway.server.last_resort import LastResort
from gateway.telemetry.metrics import GatewayMetrics
from tests.gateway.http_wire import pipelined, request
from tests.processes import eventually, free_port


async def broken(request):
    raise RuntimeError("a bug")


async def fine(request):
    return PlainTextResponse("fine")


@pytest.fixture
def server():
    metrics = GatewayMetrics("tiny")
    app = Starlette(
        routes=[Route("/v1/models", broken), Route("/fine", fine)],
        middleware=[Middleware(LastResort, metrics=metrics, endpoints={"/v1/models": "models"})],
    )
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, lifespan="off", log_config=None))
    thread = threading.Thread(target=server.run)  # off the main thread: uvicorn leaves signals alone
    thread.start()
    try:
        assert eventually(lambda: server.started, timeout=10)
        yield port, metrics
    finally:
        server.should_exit = True
        thread.join(10)


def test_an_unexpected_exception_is_a_counted_json_500_on_a_connection_that_stays_open(server, caplog):
    port, metrics = server
    with caplog.at_level(logging.ERROR, "kvserve.gateway"):
        answers = pipelined(
            port,
            [
                request("GET", "/v1/models"),
                request("GET", "/nowhere-raises"),
                request("GET", "/fine", close=True),
            ],
        )
    assert [status for status, _ in answers] == [500, 404, 200]
    error = json.loads(answers[0][1])["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "server_error"
    assert "a bug" not in error["message"]  # the client learns a request id, the log the details
    (record,) = [r for r in caplog.records if "failed unexpectedly" in r.getMessage()]
    assert record.exc_info[1].args == ("a bug",) and record.request_id in error["message"]
    assert metrics.requests.labels("unauthenticated", "models", "500", "")._value.get() == 1
