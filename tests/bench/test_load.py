"""`kvserve bench` end to end against a fake OpenAI server that streams a known number of tokens with known delays."""

import asyncio
import json
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from bench.load import main
from tests.processes import free_port

MODEL = "fake-model"
TOKENS = 8
FIRST_DELAY = 0.15  # seconds before the first content chunk
TOKEN_DELAY = 0.02  # between content chunks
PROMPT_TOKENS, CACHED_TOKENS = 10, 4


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def _events(chat: bool, fail_mid_stream: bool, kvserve_like: bool):
    if chat:  # OpenAI's role chunk comes at once and carries no content: it must not count as the first token
        yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], "usage": None})
    await asyncio.sleep(FIRST_DELAY)
    for i in range(TOKENS):
        if i:
            await asyncio.sleep(TOKEN_DELAY)
        if fail_mid_stream and i == 3:
            yield _sse({"error": {"message": "executor lost", "type": "server_error"}})
            return
        choice = {"index": 0, "delta": {"content": f" t{i}"}} if chat else {"index": 0, "text": f" t{i}"}
        yield _sse({"choices": [choice], "usage": None})
    usage = {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": TOKENS,
        "total_tokens": PROMPT_TOKENS + TOKENS,
    }
    # vLLM sends prompt_tokens_details: null unless --enable-prompt-tokens-details
    usage["prompt_tokens_details"] = {"cached_tokens": CACHED_TOKENS} if kvserve_like else None
    yield _sse({"choices": [], "usage": usage})
    yield _sse("[DONE]")


async def _generate(request: Request) -> JSONResponse | StreamingResponse:
    """Chat answers like kvserve (executor header, cached_tokens); completions like vLLM (neither).
    The request number is the prompt's last word: 3 and 7 get a 400, 10 an error event mid-stream."""
    body = await request.json()
    chat = request.url.path.endswith("/chat/completions")
    if body.get("model") != MODEL or body.get("stream") is not True:
        return JSONResponse({"error": {"message": "bad model or stream"}}, status_code=404)
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True
    text = body["messages"][0]["content"] if chat else body["prompt"]
    number = int(text.split()[-1])
    if chat and number in (3, 7):
        return JSONResponse({"error": {"message": f"max_tokens too large ({number})"}}, status_code=400)
    headers = {"x-kvserve-executor": f"ex-{'ab'[number % 2]}", "x-request-id": f"r{number}"} if chat else {}
    events = _events(chat, fail_mid_stream=chat and number == 10, kvserve_like=chat)
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


async def _models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


@pytest.fixture(scope="module")
def fake_server():
    app = Starlette(
        routes=[
            Route("/v1/models", _models),
            Route("/v1/chat/completions", _generate, methods=["POST"]),
            Route("/v1/completions", _generate, methods=["POST"]),
        ]
    )
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=5)


@pytest.fixture
def numbered_prompts(monkeypatch):
    """Prompt i is "request i", so the fake server knows which request it serves."""
    from bench import load
    from bench.prompts import Prompt

    class Numbered:
        def prompt(self, i: int) -> Prompt:
            return Prompt(f"request {i}", None)

    monkeypatch.setattr(load, "workload_from_args", lambda args: Numbered())


def test_closed_loop_against_kvserve_like_server(fake_server, numbered_prompts, tmp_path, capsys):
    out = tmp_path / "run.json"
    args = ["--url", fake_server, "--concurrency", "4", "--num-requests", "12", "--max-tokens", str(TOKENS)]
    assert main([*args, "--ignore-eos", "--output", str(out)]) == 0
    report = json.loads(out.read_text())

    ok = [i for i in range(12) if i not in (3, 7, 10)]
    assert (report["completed"], report["failed"]) == (9, 3)
    assert report["output_tokens"] == 9 * TOKENS
    assert report["errors"]["count"] == 3
    messages = report["errors"]["messages"]
    assert sum("HTTP 400" in m and "max_tokens too large" in m for m in messages) == 2
    assert any("executor lost" in m for m in messages)
    assert report["executors"] == {"ex-a": sum(i % 2 == 0 for i in ok), "ex-b": sum(i % 2 == 1 for i in ok)}
    assert report["cached_token_share"] == pytest.approx(CACHED_TOKENS / PROMPT_TOKENS)

    assert report["ttft_ms"]["p50"] >= FIRST_DELAY * 1000
    requests = {r["index"]: r for r in report["requests"]}
    assert sorted(requests) == list(range(12))
    # the server's id for each request, to find it in the server's log (bench/faults/executor_kill.py does)
    streamed = [i for i in range(12) if i not in (3, 7)]  # the two 400s carry no headers
    assert [requests[i]["request_id"] for i in streamed] == [f"r{i}" for i in streamed]
    for i in ok:
        assert requests[i]["ttft_s"] >= FIRST_DELAY
        assert len(requests[i]["itl_s"]) == TOKENS - 1
    assert report["itl_ms"]["p50"] >= TOKEN_DELAY * 1000 * 0.5
    assert report["tpot_ms"]["mean"] >= TOKEN_DELAY * 1000 * 0.9
    assert report["config"]["model"] == MODEL and report["config"]["concurrency"] == 4
    # three waves of four requests, each about FIRST_DELAY + 7 * TOKEN_DELAY
    assert report["duration_s"] >= 3 * FIRST_DELAY

    summary = capsys.readouterr()
    assert "9 ok, 3 failed" in summary.out and "ex-a" in summary.out
    assert "12/12 requests" in summary.err


def test_open_loop_against_vllm_like_server(fake_server, numbered_prompts, tmp_path):
    out = tmp_path / "run.json"
    args = ["--url", fake_server + "/v1/", "--endpoint", "completions", "--request-rate", "inf"]
    args += ["--num-requests", "6", "--max-tokens", str(TOKENS), "--ignore-eos", "--no-progress"]
    assert main([*args, "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["completed"], report["failed"], report["output_tokens"]) == (6, 0, 6 * TOKENS)
    # no executor header, no cached_tokens: absent, not errors
    assert report["executors"] == {} and report["cached_token_share"] is None
    # all at once: every request waited about one FIRST_DELAY, not six
    assert report["duration_s"] < 6 * FIRST_DELAY


def test_unreachable_server_and_bad_flags(numbered_prompts, capsys):
    assert main(["--url", f"http://127.0.0.1:{free_port()}", "--num-requests", "1"]) == 1
    assert main(["--request-rate", "inf", "--duration", "5"]) == 2
    assert "--request-rate inf needs --num-requests" in capsys.readouterr().err


def test_duration_stops_new_requests_and_lets_running_ones_finish(fake_server, numbered_prompts, tmp_path):
    out = tmp_path / "run.json"
    args = ["--url", fake_server, "--concurrency", "2", "--duration", "0.05", "--max-tokens", str(TOKENS)]
    assert main([*args, "--ignore-eos", "--no-progress", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    # both clients start one request at once; each outlasts the 0.05 s, so neither starts another
    assert (report["completed"], report["failed"], report["output_tokens"]) == (2, 0, 2 * TOKENS)


def test_ramp_up_staggers_the_clients_first_requests(fake_server, numbered_prompts, tmp_path):
    out = tmp_path / "run.json"
    args = ["--url", fake_server, "--concurrency", "4", "--num-requests", "4", "--ramp-up", "0.2"]
    assert (
        main([*args, "--max-tokens", str(TOKENS), "--ignore-eos", "--no-progress", "--output", str(out)]) == 0
    )
    starts = sorted(r["start_s"] for r in json.loads(out.read_text())["requests"])
    # clients start 0.05 s apart: none before its turn (a busy machine may start one late, never early)
    for k, start in enumerate(starts):
        assert start >= 0.05 * k - 0.01, starts
    assert main(["--url", fake_server, "--concurrency", "2", "--ramp-up", "-1"]) == 2
