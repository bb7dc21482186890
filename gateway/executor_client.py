"""ZeroMQ DEALER connections from the gateway to executors: requests out, per-step updates back, routed by
request id to the stream that waits for them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import zmq
import zmq.asyncio

from shared import protocol

log = logging.getLogger("kvserve.gateway")

LIVENESS_CHECK_S = 1.0  # how long to wait for an update before asking Redis whether the executor still lives


class ExecutorRequestError(Exception):
    """The executor refused or failed a request (code is HTTP-like: 400, 503, 500)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class ExecutorGone(Exception):
    """The executor stopped answering: its heartbeat expired in Redis."""


class ExecutorClient:
    def __init__(self) -> None:
        self.context = zmq.asyncio.Context()
        self.sockets: dict[str, zmq.asyncio.Socket] = {}
        self.readers: dict[str, asyncio.Task] = {}
        self.streams: dict[str, asyncio.Queue] = {}

    def _socket(self, address: str) -> zmq.asyncio.Socket:
        socket = self.sockets.get(address)
        if socket is None:
            socket = self.context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(address)
            self.sockets[address] = socket
            self.readers[address] = asyncio.get_running_loop().create_task(self._read(address, socket))
        return socket

    async def _read(self, address: str, socket: zmq.asyncio.Socket) -> None:
        while True:
            try:
                payload = await socket.recv()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            try:
                msg = protocol.decode(payload)
            except protocol.ProtocolError as error:
                log.warning("bad message from executor %s: %s", address, error)
                continue
            if isinstance(msg, protocol.StepBatch):
                for update in msg.outputs:
                    queue = self.streams.get(update.request_id)
                    if queue is not None:
                        queue.put_nowait(update)
            elif isinstance(msg, protocol.RequestError):
                queue = self.streams.get(msg.request_id)
                if queue is not None:
                    queue.put_nowait(ExecutorRequestError(msg.message, msg.code))

    async def generate(
        self,
        address: str,
        request: protocol.GenerateRequest,
        is_alive: Callable[[], Awaitable[bool]],
    ) -> AsyncIterator[protocol.RequestUpdate]:
        """Send the request; yield its updates until it finishes. Leaving early (a client that went away, a
        stop string matched) aborts it on the executor, so its blocks are freed. While no update comes,
        is_alive is asked every LIVENESS_CHECK_S; an executor that is gone raises ExecutorGone."""
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[request.request_id] = queue
        finished = False
        socket = self._socket(address)
        try:
            await socket.send(protocol.encode(request))
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), LIVENESS_CHECK_S)
                except TimeoutError:
                    if not await is_alive():
                        # the abort sent on the way out still matters if it was only slow, not dead
                        raise ExecutorGone(address) from None
                    continue
                if isinstance(item, ExecutorRequestError):
                    finished = True  # refused: nothing runs there
                    raise item
                if item.finish_reason is not None:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            self.streams.pop(request.request_id, None)
            if not finished:
                await self.abort(address, request.request_id)

    async def abort(self, address: str, request_id: str) -> None:
        try:
            await self._socket(address).send(protocol.encode(protocol.AbortRequest(request_id)))
        except zmq.ZMQError as error:
            log.warning("could not send abort for %s to %s: %s", request_id, address, error)

    async def close(self) -> None:
        for task in self.readers.values():
            task.cancel()
        for socket in self.sockets.values():
            socket.close(linger=0)
        self.context.term()
