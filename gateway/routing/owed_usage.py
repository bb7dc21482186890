"""What the KV of requests this gateway aborted held, still owed by their executors.

An executor answers an abort at its next step, so a request's last update, which says what its KV held, comes
after nobody reads its stream any more; the tenant is billed for it all the same. Each debt is kept for
OWED_USAGE_WAIT_S, answered or not, so whoever asks after the request has ended finds the answer."""

from __future__ import annotations

import asyncio

# how long the executor of a request this gateway aborted has to say what the request's KV held: it answers an
# abort at its next step; one that does not answer in this time (it died) is not waited for any longer
OWED_USAGE_WAIT_S = 30.0


class OwedUsage:
    def __init__(self) -> None:
        # request id -> (its executor's address, what that executor will say its KV held)
        self.owed: dict[str, tuple[str, asyncio.Future[float | None]]] = {}

    def owe(self, address: str, request_id: str, told: float | None = None) -> None:
        """The request was aborted on the executor at address; told: what its last update, already come but
        never read, said its KV held."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.owed[request_id] = (address, future)
        loop.call_later(OWED_USAGE_WAIT_S, self._expire, request_id, future)
        if told is not None:
            future.set_result(told)

    def of(self, request_id: str) -> asyncio.Future[float | None] | None:
        """The KV block-seconds the request's executor says it held, once it has ended it (None if it does not
        say within OWED_USAGE_WAIT_S). None: nothing is owed, its last update was read."""
        owed = self.owed.get(request_id)
        return None if owed is None else owed[1]

    def told(self, address: str, request_id: str, kv_block_seconds: float) -> None:
        """The last update of a request this gateway no longer reads, from the executor it aborted it on."""
        owed = self.owed.get(request_id)
        if owed is not None and owed[0] == address and not owed[1].done():
            owed[1].set_result(kv_block_seconds)

    def _expire(self, request_id: str, future: asyncio.Future[float | None]) -> None:
        if self.owed.get(request_id, (None, None))[1] is future:
            del self.owed[request_id]
        if not future.done():
            future.set_result(None)
