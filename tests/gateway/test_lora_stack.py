"""LoRA adapters over HTTP, through real processes: two executors with --enable-lora (one serving `sql` and `chat`,
the other `sql` alone) behind a gateway that requires keys. A request's `model` names an adapter its key owns; it
runs under that adapter (other tokens than the base model's), caches apart from the base, goes only where the
adapter is served, and is counted per adapter; another tenant's adapter is a 404 exactly as an unknown model. Run-time
loads are an operator's, with --allow-runtime-lora-updating."""

from __future__ import annotations

import functools
import json

import httpx
import pytest

from shared import redis_keys
from shared.adapter_names import MAX_RUNTIME_ADAPTERS
from tests.executor.lora.conftest import make_adapter
from tests.gateway.answers import metric_samples, metric_total, openai_error
from tests.processes import eventually, free_port
from tests.stacks import serving_stack

post = functools.partial(httpx.post, timeout=120)
# four full 16-token blocks and then some, whatever the tokenizer does with it
PROMPT = "The quick brown fox jumps over the lazy dog while the cat watches from the old stone wall. " * 5


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-http")
    fields = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    return {
        name: make_adapter(tiny_models["llama"], root / name, seed, **fields)[0]
        for seed, name in enumerate(("sql", "chat"))
    }


@pytest.fixture(scope="module")
def stack(tiny_models, adapters, tmp_path_factory):
    both = ("--lora-modules", f"sql={adapters['sql']}", f"chat={adapters['chat']}", "--max-loras", "2")
    with serving_stack(
        tiny_models["llama"],
        tmp_path_factory.mktemp("lora-stack"),
        executors=[("--enable-lora", *both), ("--enable-lora", "--lora-modules", f"sql={adapters['sql']}")],
        gateways=[("--metrics-port", str(free_port()), "--allow-runtime-lora-updating"), ()],
        gateway_flags=("--require-api-key",),
        tenants=("bootstrap",),
    ) as stack:
        store = stack.key_store()
        stack.keys["acme"] = store.create("acme", adapters=["sql"])[0]
        stack.keys["beta"] = store.create("beta", adapters=["chat", "sql2"])[0]
        stack.keys["ops"] = store.create("ops", operator=True)[0]
        yield stack


def _auth(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


def _complete(base: str, key: str, model: str, prompt: str = PROMPT) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    return post(f"{base}/v1/completions", json=body, headers=_auth(key))


def _models(base: str, key: str) -> list[str]:
    response = httpx.get(f"{base}/v1/models", headers=_auth(key))
    assert response.status_code == 200, response.text
    return [m["id"] for m in response.json()["data"]]


def test_models_lists_the_base_and_the_keys_own_adapters_that_are_served(stack):
    assert _models(stack.base, stack.keys["acme"]) == ["tiny", "sql"]
    assert _models(stack.base, stack.keys["beta"]) == ["tiny", "chat"]  # sql2 is served nowhere
    assert _models(stack.base, stack.keys["bootstrap"]) == ["tiny"]  # no adapters field: the base model only
    data = httpx.get(f"{stack.base}/v1/models", headers=_auth(stack.keys["acme"])).json()["data"]
    assert data[1]["parent"] == "tiny" and data[0]["parent"] is None


def test_an_adapters_request_runs_under_it_and_shares_no_cached_block_with_the_base(stack):
    prompt = "Adapters and the base model never share a block. " + PROMPT
    base = _complete(stack.base, stack.keys["acme"], "tiny", prompt)
    first = _complete(stack.base, stack.keys["acme"], "sql", prompt)
    again = _complete(stack.base, stack.keys["acme"], "sql", prompt)
    for response in (base, first, again):
        assert response.status_code == 200, response.text
    assert first.json()["model"] == "sql"
    assert first.json()["choices"][0]["text"] != base.json()["choices"][0]["text"]  # the adapter changed it
    assert first.json()["choices"][0]["text"] == again.json()["choices"][0]["text"]
    cached = [
        r.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) for r in (first, again)
    ]
    assert cached[0] == 0 and cached[1] >= 64  # its own blocks on a repeat, none of the base's before
    assert again.headers["x-kvserve-executor"] == first.headers["x-kvserve-executor"]


def test_an_adapter_goes_only_to_the_executors_that_serve_it(stack):
    serving_chat = stack.executors[0].id
    for i in range(4):
        response = _complete(
            stack.base, stack.keys["beta"], "chat", f"Request {i} for the chat adapter only."
        )
        assert response.status_code == 200, response.text
        assert response.headers["x-kvserve-executor"] == serving_chat


def test_another_tenants_adapter_is_refused_exactly_as_an_unknown_model(stack):
    theirs = _complete(stack.base, stack.keys["acme"], "chat")
    unknown = _complete(stack.base, stack.keys["acme"], "nope")
    assert openai_error(theirs, 404)["code"] == "model_not_found"
    assert theirs.text.replace("chat", "MODEL") == unknown.text.replace("nope", "MODEL")
    chat = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
    for path, body in (("/v1/chat/completions", chat), ("/v1/responses", {"model": "chat", "input": "hi"})):
        assert openai_error(post(f"{stack.base}{path}", json=body, headers=_auth(stack.keys["acme"])), 404)


def test_usage_and_metrics_count_each_adapter_apart(stack):
    store = stack.key_store()
    before = store.usage("acme").get("acme", {}).get("requests:adapter:sql", 0)
    response = _complete(stack.base, stack.keys["acme"], "sql", "Counted under its adapter.")
    assert response.status_code == 200, response.text
    usage = store.usage("acme")["acme"]
    assert usage["requests:adapter:sql"] == before + 1
    assert usage["completion_tokens:adapter:sql"] >= 8 and usage["prompt_tokens:adapter:sql"] > 0
    samples = metric_samples(stack.gateway.metrics_url)
    assert metric_total(samples, "kvserve_requests_total", tenant="acme", adapter="sql", status="200") >= 1
    assert metric_total(samples, "kvserve_generation_tokens_total", tenant="acme", adapter="sql") >= 8


def test_keys_update_gives_a_key_an_adapter_from_its_next_request(stack):
    store = stack.key_store()
    key, record = store.create("gamma")
    assert openai_error(_complete(stack.base, key, "sql"), 404)["code"] == "model_not_found"
    store.update(record.key_id, adapters=["sql"])
    assert _models(stack.base, key) == ["tiny", "sql"]
    assert _complete(stack.base, key, "sql").status_code == 200


def _load(base: str, key: str, **body) -> httpx.Response:
    return post(f"{base}/v1/load_lora_adapter", json=body, headers=_auth(key))


def test_loading_adapters_is_an_operators_and_bounded(stack, tmp_path):
    base, ops = stack.base, stack.keys["ops"]
    second = stack.gateways[1].base  # without --allow-runtime-lora-updating
    assert openai_error(_load(second, ops, lora_name="x", lora_path="/x"), 404)["type"] == "not_found_error"
    assert openai_error(_load(base, stack.keys["acme"], lora_name="x", lora_path="/x"), 403)["type"] == (
        "permission_error"
    )
    for body, param in [
        ({"lora_name": "bad name", "lora_path": "/x"}, "lora_name"),
        ({"lora_name": "x" * 129, "lora_path": "/x"}, "lora_name"),
        ({"lora_name": "x", "lora_path": "relative/dir"}, "lora_path"),
        ({"lora_name": "x", "lora_path": "/" + "a" * 4096}, "lora_path"),
        ({"lora_name": "x"}, "lora_path"),
        ({"lora_name": "x", "lora_path": "/x", "load_inplace": True}, "load_inplace"),
        ({"lora_name": "sql", "lora_path": "/x"}, "lora_name"),  # served from --lora-modules already
    ]:
        assert openai_error(_load(base, ops, **body), 400)["param"] == param, body
    assert not stack.redis.exists(redis_keys.LORA_ADAPTERS)  # nothing refused was written
    client = stack.redis
    fillers = {f"filler-{i}": json.dumps({"path": f"/nonexistent/{i}"}) for i in range(MAX_RUNTIME_ADAPTERS)}
    client.hset(redis_keys.LORA_ADAPTERS, mapping=fillers)
    try:
        full = openai_error(_load(base, ops, lora_name="one-more", lora_path=str(tmp_path)), 400)
        assert f"{MAX_RUNTIME_ADAPTERS} adapters" in full["message"]
    finally:
        client.delete(redis_keys.LORA_ADAPTERS)
    unknown = post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "never"}, headers=_auth(ops))
    assert openai_error(unknown, 404)["param"] == "lora_name"


def test_a_loaded_adapter_is_served_then_unloaded_and_a_refused_one_is_taken_back(stack, adapters, tmp_path):
    base, ops = stack.base, stack.keys["ops"]
    loaded = _load(base, ops, lora_name="sql2", lora_path=adapters["sql"])
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'sql2' added successfully."
    assert _models(base, stack.keys["beta"]) == ["tiny", "chat", "sql2"]
    # neither executor holds its weights yet: the first request loads them where it goes, and the next ones
    # (other prompts, nothing cached to draw them) follow it there, rather than half of them loading it again
    first = _complete(base, stack.keys["beta"], "sql2", "Where is sql2 loaded?")
    assert first.status_code == 200, first.text
    holder = first.headers["x-kvserve-executor"]
    assert eventually(lambda: "sql2" in stack.redis.hget(redis_keys.load_key(holder), "lora_held").split(","))
    for i in range(4):
        response = _complete(base, stack.keys["beta"], "sql2", f"Another question {i} for sql2.")
        assert response.status_code == 200 and response.headers["x-kvserve-executor"] == holder
    assert (
        _load(base, ops, lora_name="sql2", lora_path=adapters["chat"]).status_code == 400
    )  # unload it first

    refused = openai_error(_load(base, ops, lora_name="empty", lora_path=str(tmp_path)), 400)
    assert "refused" in refused["message"] and "empty" in refused["message"]
    assert not stack.redis.hexists(redis_keys.LORA_ADAPTERS, "empty")
    # at once from a good path: the refusal of the empty one, still in the registrations until the executors'
    # next heartbeat, is not this load's
    fixed = _load(base, ops, lora_name="empty", lora_path=adapters["chat"])
    assert fixed.status_code == 200, fixed.text
    assert (
        post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "empty"}, headers=_auth(ops)).status_code
        == 200
    )

    unloaded = post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "sql2"}, headers=_auth(ops))
    assert unloaded.status_code == 200, unloaded.text
    assert _models(base, stack.keys["beta"]) == ["tiny", "chat"]
    assert openai_error(_complete(base, stack.keys["beta"], "sql2"), 404)["code"] == "model_not_found"
