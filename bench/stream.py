"""One streamed request to an OpenAI-compatible server, timed chunk by chunk."""

from __future__ import annotations

import json
import time

import httpx

from bench.metrics import RequestResult

EXECUTOR_HEADER = "x-kvserve-executor"
REQUEST_ID_HEADER = "x-request-id"


def _error_text(body: str) -> str:
    """OpenAI's `{"error": {"message": ...}}` (or a bare string) when the body has it, else the body itself."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return body.strip()[:300]
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error if error is not None else body.strip()[:300])


def _chunk_text(choice: dict, chat: bool) -> str | None:
    if chat:
        return (choice.get("delta") or {}).get("content")
    return choice.get("text")


async def stream_request(
    client: httpx.AsyncClient, path: str, body: dict, index: int, run_start: float
) -> RequestResult:
    """POST `body` with stream=true and record when each content chunk arrived; never raises for the server's
    faults: an HTTP error, an `{"error": ...}` event, a broken stream or a missing [DONE] become `error`."""
    chat = path.endswith("/chat/completions")
    result = RequestResult(index)
    sent = time.perf_counter()
    result.start = sent - run_start
    try:
        async with client.stream("POST", path, json=body) as response:
            result.executor = response.headers.get(EXECUTOR_HEADER)
            result.request_id = response.headers.get(REQUEST_ID_HEADER)
            if response.status_code >= 400:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {_error_text(text)}"
                return result
            finished = False
            completion_tokens = None
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, `: keep-alive` comments, `event:` lines
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    finished = True
                    break
                now = time.perf_counter()
                event = json.loads(data)
                if event.get("error"):
                    result.error = f"stream error: {_error_text(data)}"
                    break
                choices = event.get("choices") or []
                if choices and _chunk_text(choices[0], chat):
                    result.chunk_times.append(now - sent)
                usage = event.get("usage")
                if usage:
                    completion_tokens = usage.get("completion_tokens")
                    result.prompt_tokens = usage.get("prompt_tokens")
                    # vLLM sends prompt_tokens_details: null unless asked to; absent is not zero
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens")
            if result.error is None and not finished:
                result.error = "stream ended before data: [DONE]"
            # a server that sends no usage: count content chunks, one token each (exact for kvserve and vLLM
            # without speculative decoding)
            result.output_tokens = (
                completion_tokens if completion_tokens is not None else len(result.chunk_times)
            )
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    except json.JSONDecodeError as error:
        result.error = f"bad event JSON: {error}"
    finally:
        result.e2e = time.perf_counter() - sent
    return result
