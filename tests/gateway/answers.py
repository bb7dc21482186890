"""The gateway's answers read as a client reads them: an OpenAI error's shape, an event stream's events, the
samples of a /metrics page."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator

import httpx

DONE = "[DONE]"
OPENAI_ERROR_FIELDS = {"message", "type", "param", "code"}


def openai_error(response: httpx.Response, status: int) -> dict:
    """The error of an answer that must have this status, in OpenAI's shape with a message."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == OPENAI_ERROR_FIELDS and error["message"], error
    return error


def sse_events(text: str) -> list[dict | str]:
    """Every event of a whole event stream, in order: its JSON, or DONE. Anything but `data:` events fails."""
    events = []
    for block in text.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            payload = block.removeprefix("data: ")
            events.append(payload if payload == DONE else json.loads(payload))
    return events


def json_events(lines: Iterable[str]) -> Iterator[dict]:
    """The JSON events of a stream read line by line (httpx's iter_lines), as they come."""
    for line in lines:
        if line.startswith("data: {"):
            yield json.loads(line.removeprefix("data: "))


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def metric_samples(url: str) -> Samples:
    """(name, sorted labels) -> value of every sample a /metrics page shows."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(httpx.get(url).text)
        for s in family.samples
    }


def metric_total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples of this name whose labels include these."""
    return sum(
        value
        for (sample, sample_labels), value in samples.items()
        if sample == name and set(labels.items()) <= set(sample_labels)
    )
