"""The fuzz target's judge: what counts as an answer that broke the rules."""

from __future__ import annotations

import json

import pytest

from bench.faults.fuzz import executor_load, idle, problem

ERROR = json.dumps(
    {
        "error": {
            "message": "max_tokens must be at least 1",
            "type": "invalid_request_error",
            "param": "max_tokens",
            "code": None,
        }
    }
).encode()

EMPTY_MESSAGE = b'{"error": {"message": "", "type": "x", "param": null, "code": null}}'
SERVER_ERROR_EVENT = b'data: {"error":{"type":"server_error"}}\n\ndata: [DONE]\n\n'


@pytest.mark.parametrize(
    "status, content_type, body",
    [
        (400, "application/json", ERROR),
        (415, "application/json", ERROR),
        (200, "application/json", b'{"choices": [{"text": "hi"}]}'),
        (200, "text/event-stream", b'data: {"choices": []}\n\ndata: [DONE]\n\n'),
        # refused by the executor after the stream began: the client's error, in the stream
        (200, "text/event-stream", b'data: {"error":{"type":"invalid_request_error"}}\n\ndata: [DONE]\n\n'),
    ],
)
def test_4xx_in_openais_shape_and_whole_200s_pass(status, content_type, body):
    assert problem(status, content_type, body) is None


@pytest.mark.parametrize(
    "status, content_type, body, why",
    [
        (500, "text/plain", b"Internal Server Error", "status 500"),
        (502, "application/json", ERROR, "status 502"),
        (400, "text/plain", b"bad", "not JSON"),
        (400, "application/json", b'{"detail": "bad"}', "OpenAI's error shape"),
        (404, "application/json", EMPTY_MESSAGE, "empty"),
        (200, "application/json", b'{"object": "list"}', "without choices"),
        (200, "text/event-stream", b'data: {"choices": []}\n\n', "[DONE]"),
        (200, "text/event-stream", SERVER_ERROR_EVENT, "error event"),
        (301, "text/html", b"", "status 301"),
    ],
)
def test_5xx_shapeless_errors_and_broken_answers_are_problems(status, content_type, body, why):
    assert why in problem(status, content_type, body)


def test_idle_needs_every_executor_seen_and_empty():
    page = "\n".join(
        [
            "# TYPE kvserve_kv_blocks_used gauge",
            'kvserve_kv_blocks_used{executor="a"} 0.0',
            'kvserve_kv_blocks_used{executor="b"} 3.0',
            "# TYPE kvserve_running_requests gauge",
            'kvserve_running_requests{executor="a"} 0.0',
            'kvserve_running_requests{executor="b"} 0.0',
        ]
    )
    load = executor_load(page)
    assert load["b"]["kv_blocks_used"] == 3 and not idle(load)
    assert idle({"a": load["a"]}) and not idle({})
