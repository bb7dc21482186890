"""A few threads that parse, template and tokenize large requests (and decode large stored responses,
gateway/response_store.py), so the event loop goes on serving /health/live and every other stream while a megabyte
prompt is worked through.

Only a large body goes there: for a small one the hop to a thread costs more than the work. In a worker, json and
jinja hold the GIL but hand it over at every switch interval (5 ms), so the loop keeps its turns; the tokenizer
releases it for long texts (gateway.prompt.tokenizer.Tokenizer.encode), so its work runs beside the loop's.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

# a 4 KiB prompt takes 2-8 ms to tokenize on a busy 2-core machine: beyond that the loop would stall for far
# longer than the hop to a thread (tens of us) costs
INLINE_BYTES = 4 * 1024
# bounded: only callers with a valid key get here, and more threads would only share the GIL more ways
WORKERS = 2


class PromptWorkers:
    def __init__(self, workers: int = WORKERS, inline_bytes: int = INLINE_BYTES) -> None:
        self.inline_bytes = inline_bytes
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="kvserve-prompt")

    async def run(self, work: Callable[[], T], size: int) -> T:
        """work(): here when size (the body's bytes) is small, else in a worker, with this task's log ids.
        Cancelled while it waits for a worker, it never runs."""
        if size <= self.inline_bytes:
            return work()
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self.pool, context.run, work)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
