"""The gateway's output layer over real engine steps gives the offline API's text, stop strings included."""

from __future__ import annotations

import json

import pytest

from executor import LLM, SamplingParams
from gateway.openai.request import fit_to_context, parse_chat_request
from gateway.openai.responses import EventStream, Generation, response_body
from gateway.prompt.token_ids import prompt_token_ids


@pytest.fixture(scope="module")
def llm(default_model):
    return LLM(model=default_model, kv_cache_memory=64 * 1024 * 1024, max_model_len=512)


def stream_through_engine(llm: LLM, body: dict) -> tuple[Generation, str, list[int]]:
    request = parse_chat_request(json.dumps(body).encode(), ["m"])
    prompt = prompt_token_ids(request, llm.tokenizer)
    params = fit_to_context(request, len(prompt), 512)
    generation = Generation.start(request, prompt, params.stop, llm.tokenizer)
    stream = EventStream(generation, request.include_usage)
    llm.engine.add_request("r", prompt, params)
    events = ""
    while not generation.finished:
        for out in llm.engine.step().outputs:
            events += stream.update(
                out.new_token_ids, out.new_logprobs, out.finish_reason, out.num_cached_tokens
            )
        if generation.stop_matched:
            llm.engine.abort("r")  # what the HTTP app does once a stop string matched
    assert not llm.engine.has_unfinished()
    return generation, events, prompt


@pytest.mark.parametrize(
    "stop", [None, ["nend", "zzz"]]
)  # "nend" straddles " un" + "ending" in the greedy text
def test_streamed_text_equals_offline_generate(llm, stop):
    body = {
        "messages": [{"role": "user", "content": "Write one sentence about the sea."}],
        "max_tokens": 24,
        "temperature": 0,
        "stop": stop,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    generation, events, prompt = stream_through_engine(llm, body)
    expected = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, stop=stop))[0].outputs[0]
    deltas = [
        json.loads(e[6:])["choices"][0]["delta"].get("content", "")
        for e in events.split("\n\n")[:-1]
        if e != "data: [DONE]" and json.loads(e[6:])["choices"]
    ]
    assert "".join(deltas) == response_body(generation)["choices"][0]["message"]["content"] == expected.text
    assert generation.finish_reason == expected.finish_reason
    assert generation.stop_matched == (stop is not None)  # the stop case really stops, mid-generation
    assert events.endswith("data: [DONE]\n\n")
    usage = json.loads(events.split("\n\n")[-3][6:])["usage"]
    assert usage["prompt_tokens"] == len(prompt) and usage["completion_tokens"] >= 1
