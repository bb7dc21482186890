"""Structured outputs through the real stack (the shared default_model_stack, over HTTP): the openai client's
parse() gets objects, JSON mode parses, and a schema the executor cannot compile is a 400 that stops nothing."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.gateway.answers import DONE, sse_events

TIMEOUT = 600  # twenty constrained streams on a busy 2-core machine


class City(BaseModel):
    name: Annotated[str, Field(max_length=24)]
    country: Annotated[str, Field(max_length=24)]
    population_millions: Annotated[int, Field(ge=0, le=100)]


PROMPTS = [
    "Tell me about Paris.",
    "Describe Tokyo.",
    "What is Lagos like?",
    "Give facts about Lima.",
    "A city in Canada, please.",
    "Which city hosts the Colosseum?",
    "Name a big city in India.",
    "Describe the capital of Kenya.",
    "Tell me about a city on the Danube.",
    "Where is the Sydney Opera House?",
    "What is the largest city in Brazil?",
    "A German city famous for beer.",
    "Describe Cairo in one line.",
    "Tell me about Seoul.",
    "The capital of Spain?",
    "A city in Mexico.",
    "Describe Istanbul.",
    "What city is Big Ben in?",
    "A Scandinavian capital.",
    "Tell me about Buenos Aires.",
]


@pytest.fixture(scope="module")
def stack(default_model_stack) -> str:
    return default_model_stack.base


def chat(base: str, **body) -> httpx.Response:
    body = {"model": "tiny", "max_tokens": 48, "temperature": 0, **body}
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=TIMEOUT)


@pytest.mark.slow
def test_openai_parse_gives_an_object_for_every_prompt(stack):
    client = openai.OpenAI(base_url=f"{stack}/v1", api_key="none", timeout=TIMEOUT, max_retries=0)

    def parse(prompt: str):
        return client.chat.completions.parse(
            model="tiny",
            messages=[{"role": "user", "content": prompt}],
            response_format=City,
            max_tokens=64,
            temperature=0.7,
            seed=len(prompt),
        )

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        completions = list(pool.map(parse, PROMPTS))
    for completion in completions:
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, City), choice.message.content


def test_json_mode_outputs_parse_streamed_or_not(stack):
    fields = dict(
        messages=[{"role": "user", "content": "Reply with a short JSON object giving a cat's name and age."}],
        response_format={"type": "json_object"},
        max_tokens=200,
    )
    plain = chat(stack, **fields)
    assert plain.status_code == 200, plain.text
    assert plain.json()["choices"][0]["finish_reason"] == "stop"
    text = plain.json()["choices"][0]["message"]["content"]
    assert isinstance(json.loads(text), dict)
    streamed = chat(stack, stream=True, **fields)
    events = [e for e in sse_events(streamed.text) if e != DONE]
    pieces = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert pieces == text


def test_guided_choice_and_regex_on_completions(stack):
    body = {"model": "tiny", "prompt": "Is fire hot? Answer:", "max_tokens": 8, "temperature": 0}
    choice = httpx.post(
        f"{stack}/v1/completions", json={**body, "guided_choice": ["yes", "no"]}, timeout=TIMEOUT
    )
    assert choice.json()["choices"][0]["text"] in ("yes", "no")
    regex = {"structured_outputs": {"regex": "[0-9]{2}"}}
    assert (
        len(
            httpx.post(f"{stack}/v1/completions", json={**body, **regex}, timeout=TIMEOUT).json()["choices"][
                0
            ]["text"]
        )
        == 2
    )


def test_a_schema_the_executor_cannot_compile_is_a_400_and_others_continue(stack):
    bad = {
        "type": "json_schema",
        "json_schema": {
            "name": "bad",
            "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}},
        },
    }
    with ThreadPoolExecutor(2) as pool:
        plain = pool.submit(chat, stack, messages=[{"role": "user", "content": "Hi"}], max_tokens=16)
        # the first time it compiles while queued; the second time the cache knows it fails
        for _ in range(2):
            refused = chat(stack, messages=[{"role": "user", "content": "Hi"}], response_format=bad)
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert error["param"] == "response_format.json_schema.schema"
            assert error["message"].startswith(
                "response_format.json_schema.schema: Cannot find field 'nowhere'"
            )
        assert plain.result().status_code == 200
    assert chat(stack, messages=[{"role": "user", "content": "Hi"}], guided_regex="(ab").status_code == 400
    assert chat(stack, messages=[{"role": "user", "content": "Hi"}], max_tokens=2).status_code == 200
