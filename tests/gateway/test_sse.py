"""Server-sent events stay one line each for every line reader, whatever text a token carries."""

import json

import httpx

from gateway.api_error import APIError
from gateway.openai.sse import sse_data


def test_an_event_is_one_line_for_splitlines_readers_and_decodes_to_the_same_text():
    text = 'a\x85b\u2028c\u2029d\ne\r"é 😀'
    events = [
        (sse_data({"text": text}), lambda payload: payload["text"]),
        (APIError(400, text).sse_event(), lambda payload: payload["error"]["message"]),
    ]
    for event, read in events:
        assert event.endswith("\n\n") and len(event[:-2].splitlines()) == 1
        # httpx's line decoder (GuideLLM reads streams with it) sees the same single line
        lines = [line for line in httpx.Response(200, content=event.encode()).iter_lines() if line]
        assert len(lines) == 1
        assert read(json.loads(lines[0].removeprefix("data: "))) == text
    assert sse_data({"text": "plain ascii"}) == 'data: {"text":"plain ascii"}\n\n'
