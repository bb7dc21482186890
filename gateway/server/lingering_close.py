"""nginx's lingering close for the gateway's HTTP connections: a response that closes its connection while the
client is still sending the request's body (a keyless caller's large body refused with 401, a slow body's 408, a
drain's 503) half-closes it instead, then reads and throws away what still arrives, unparsed, until the client
closes its side, or for LINGER_S at most (LINGER_IDLE_S without a byte), or LINGER_BYTES, whichever comes first.

A plain close with the body's bytes unread makes the kernel answer with a reset, and a reset discards what the
client has not read yet: the client says "connection reset" where the 401 was meant. Reading what still comes
lets the response and its FIN arrive first. The bytes are dropped as they come (no HTTP parsing, no copy kept), so
a flood of them costs the gateway what its sockets carry, not its CPU.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.openai.body import MAX_BODY_BYTES

# a client sending a body within the gateway's own limit reads its answer; one sending more is cut off
LINGER_BYTES = MAX_BODY_BYTES
LINGER_S = 5.0  # nginx's lingering_time is 30 s: a refused body gets a short time, not a body deadline's
LINGER_IDLE_S = 2.0  # nginx's lingering_timeout is 5 s


class _Transport:
    """The connection's transport as uvicorn sees it: its close() lingers while the request's body is unread."""

    def __init__(self, transport: asyncio.Transport, protocol: LingeringHttpToolsProtocol) -> None:
        self._transport = transport
        self._protocol = protocol

    def __getattr__(self, name: str):
        return getattr(self._transport, name)

    def close(self) -> None:
        if self._protocol.body_unread():
            self._protocol.linger()
        else:
            self._transport.close()

    def is_closing(self) -> bool:
        return self._protocol.lingering or self._transport.is_closing()


class LingeringHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol (the one it picks by itself when httptools is installed), closing with a linger."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lingering = False
        self._message_done = True  # the current request's body has all arrived (none started yet)
        self._at_once = False  # the connection is gone, or the server stopping: a close is a close
        self._discarded = 0
        self._timers: list[asyncio.TimerHandle] = []

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_Transport(transport, self))

    def on_message_begin(self) -> None:
        self._message_done = False
        super().on_message_begin()

    def on_message_complete(self) -> None:
        self._message_done = True
        super().on_message_complete()

    def body_unread(self) -> bool:
        """Whether the client may still be sending this request's body: closing now would reset the connection."""
        return not (self._message_done or self.lingering or self._at_once)

    def linger(self) -> None:
        """Half-close (the response already written goes first, then the FIN) and discard what still arrives."""
        transport = self._transport()
        if not transport.can_write_eof():  # TLS cannot half-close
            transport.close()
            return
        self.lingering = True
        self.flow.resume_reading()
        transport.write_eof()
        self._timers = [
            self.loop.call_later(LINGER_S, self._close),
            self.loop.call_later(LINGER_IDLE_S, self._close),
        ]

    def data_received(self, data: bytes) -> None:
        if not self.lingering:
            super().data_received(data)
            return
        self._discarded += len(data)
        if self._discarded > LINGER_BYTES:
            self._close()
            return
        self._timers[1].cancel()  # it still sends: it may still be reading too
        self._timers[1] = self.loop.call_later(LINGER_IDLE_S, self._close)

    def shutdown(self) -> None:
        """The server is stopping: a lingering connection closes now, and none starts to linger."""
        self._at_once = True
        if self.lingering:
            self._close()
        else:
            super().shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        self._at_once = True
        for timer in self._timers:
            timer.cancel()
        super().connection_lost(exc)

    def _close(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self._transport().close()

    def _transport(self) -> asyncio.Transport:
        return self.transport._transport  # type: ignore[attr-defined]
