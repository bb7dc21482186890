"""n > 1 over real HTTP (the shared keyed_stack: Redis, one executor, gateways that want API keys); the openai
client streams n = 8."""

from __future__ import annotations

import functools

import httpx
import openai
import pytest

from shared import redis_keys as keys
from shared.sampling_params import MAX_N
from tests.gateway.answers import json_events
from tests.processes import ExecutorProcess, eventually

post = functools.partial(httpx.post, timeout=120)


@pytest.fixture(scope="module")
def stack(keyed_stack):
    """(gateway base url, executor, key store, an API key without limits of this module's own tenant)."""
    store = keyed_stack.key_store()
    key, _ = store.create("nsamp-open")
    return keyed_stack.base, keyed_stack.executor, store, key


def complete(stack, key: str | None = None, **body) -> httpx.Response:
    base, _, _, open_key = stack
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 12, "ignore_eos": True} | body
    return post(f"{base}/v1/completions", json=body, headers={"authorization": f"Bearer {key or open_key}"})


def texts(response: httpx.Response) -> list[str]:
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == list(range(len(choices)))
    return [c.get("text", c.get("message", {}).get("content")) for c in choices]


def kv_idle(executor: ExecutorProcess) -> bool:
    load = executor.redis.hgetall(keys.load_key(executor.id))
    return float(load.get("kv_usage", 1)) == 0 and int(load.get("running", 1)) == 0


def test_n4_greedy_gives_four_copies_of_the_n1_answer_with_usage_counting_the_prompt_once(stack):
    single = complete(stack, temperature=0)
    group = complete(stack, temperature=0, n=4)
    assert texts(group) == texts(single) * 4
    usage, one = group.json()["usage"], single.json()["usage"]
    assert usage["prompt_tokens"] == one["prompt_tokens"]
    assert usage["completion_tokens"] == 4 * one["completion_tokens"] == 48
    base, _, _, key = stack
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    auth = {"authorization": f"Bearer {key}"}
    chat_single = post(f"{base}/v1/chat/completions", json=chat, headers=auth)
    assert (
        texts(post(f"{base}/v1/chat/completions", json=chat | {"n": 4}, headers=auth))
        == texts(chat_single) * 4
    )


def test_a_seeded_n4_request_is_reproducible_and_its_choices_differ(stack):
    first = texts(complete(stack, temperature=1.0, seed=99, n=4))
    assert texts(complete(stack, temperature=1.0, seed=99, n=4)) == first
    assert len(set(first)) == 4


def test_stop_strings_end_each_choice_on_its_own(stack):
    free = texts(complete(stack, temperature=1.0, seed=5, n=3, max_tokens=30))
    # a stop string in choice 0's second half that the others never write
    half = len(free[0]) // 2
    stop = next(
        free[0][i : i + 6]
        for i in range(half, len(free[0]) - 6)
        if all(free[0][i : i + 6] not in other for other in free[1:])
    )
    choices = complete(stack, temperature=1.0, seed=5, n=3, max_tokens=30, stop=[stop]).json()["choices"]
    # until choice 0 stops, the batch is the free run's: it ends right before its stop string
    assert (choices[0]["text"], choices[0]["finish_reason"]) == (free[0][: free[0].index(stop)], "stop")
    # the others go on to max_tokens without it (past that point their batch is smaller than in the free run,
    # and fp32 sums over another batch shape may change a sampled token, so their texts are not compared)
    for choice in choices[1:]:
        assert stop not in choice["text"] and choice["finish_reason"] == "length"
    assert eventually(lambda: kv_idle(stack[1]), timeout=10)


def test_n8_streams_through_the_openai_client(stack):
    base, _, _, key = stack
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)
    request = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=10,
        temperature=1.0,
        seed=3,
        n=8,
    )
    content, finish, usage = [""] * 8, [None] * 8, None
    stream = client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            assert finish[choice.index] is None  # nothing after a choice's end
            content[choice.index] += choice.delta.content or ""
            finish[choice.index] = choice.finish_reason
    whole = client.chat.completions.create(**request)
    assert content == [c.message.content for c in sorted(whole.choices, key=lambda c: c.index)]
    assert finish == [c.finish_reason for c in whole.choices] and all(finish)
    assert len(set(content)) > 1
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_a_disconnect_mid_stream_frees_every_choice_and_its_blocks(stack):
    base, executor, _, key = stack
    assert eventually(lambda: kv_idle(executor), timeout=10)
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 1000, "ignore_eos": True, "stream": True, "n": 4}
    headers = {"authorization": f"Bearer {key}"}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=headers, timeout=60) as response:
        seen = set()
        # held until the stream is left: an iterator dropped at the break would close the connection with it
        events = json_events(response.iter_lines())
        for event in events:  # until every choice has streamed: all four run
            seen.add(event["choices"][0]["index"])
            if len(seen) == 4:
                break

        def all_running() -> bool:  # the load is published just after the step's tokens are sent
            load = executor.redis.hgetall(keys.load_key(executor.id))
            return int(load["running"]) == 4 and float(load["kv_usage"]) > 0

        assert eventually(all_running, timeout=5)
    assert eventually(lambda: kv_idle(executor), timeout=10)


def test_n_above_the_maximum_is_400_naming_n(stack):
    response = complete(stack, n=MAX_N + 1)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "n" and f"n must be in [1, {MAX_N}]" in error["message"]


def test_tokens_per_minute_reserves_n_times_max_tokens(stack):
    _, _, store, open_key = stack
    prompt_tokens = complete(stack, max_tokens=1).json()["usage"]["prompt_tokens"]
    per_group = prompt_tokens + 4 * 8  # n 4 x max_tokens 8, ignore_eos: reserved, then used
    key, _ = store.create("tpm-nsamp", tpm=per_group + per_group // 2)
    response = complete(stack, key, n=4, max_tokens=8)
    assert response.status_code == 200 and response.json()["usage"]["total_tokens"] == per_group
    refused = complete(stack, key, n=4, max_tokens=8)
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "tokens"
    assert complete(stack, key, max_tokens=8).status_code == 200  # what is left covers one choice
    assert store.usage("tpm-nsamp")["tpm-nsamp"]["completion_tokens"] == 4 * 8 + 8
