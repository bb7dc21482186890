"""The gateway's ZeroMQ client against a real ROUTER socket in this process: a stream is exact or ends loudly."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from gateway.routing.executor_client import ExecutorClient, UpdatesLost
from shared import protocol


async def _alive() -> bool:
    return True


class Executor:
    """The executor's side of the wire: a bare ROUTER that answers as the test says."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.gateway = b""

    def receive(self) -> protocol.Message:
        """The gateway's next message but its heartbeats."""
        while True:
            assert self.socket.poll(5000), "nothing from the gateway"
            self.gateway, payload = self.socket.recv_multipart()
            message = protocol.decode(payload)
            if not isinstance(message, protocol.GatewayHeartbeat):
                return message

    def send(self, *updates: protocol.RequestUpdate) -> None:
        self.send_raw(protocol.encode(protocol.StepBatch(list(updates))))

    def send_raw(self, payload: bytes) -> None:
        self.socket.send_multipart([self.gateway, payload])

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


async def _stream(client: ExecutorClient, executor: Executor, request_id: str, received: list) -> None:
    """Submit request_id and read its updates into received until it ends."""
    await client.submit(executor.address, protocol.GenerateRequest(request_id, [1, 2, 3]))
    async for update in client.updates(executor.address, request_id, _alive):
        received.append(update)


async def _run(test) -> None:
    client, executor = ExecutorClient(), Executor()
    try:
        await asyncio.wait_for(test(client, executor), 20)
    finally:
        await client.close()
        executor.close()


def _update(
    request_id: str, seq: int, tokens: list[int], finish: str | None = None
) -> protocol.RequestUpdate:
    return protocol.RequestUpdate(request_id, tokens, None, finish, 0, seq=seq)


def test_a_gap_in_a_requests_updates_ends_its_stream_while_others_go_on():
    async def test(client: ExecutorClient, executor: Executor) -> None:
        gapped, whole = [], []
        readers = [
            asyncio.create_task(_stream(client, executor, r, out)) for r, out in (("a", gapped), ("b", whole))
        ]
        for _ in range(2):
            await asyncio.to_thread(executor.receive)
        executor.send(_update("a", 0, [5]), _update("b", 0, [6]))
        executor.send(_update("a", 2, [7]), _update("b", 1, [8]))  # a's update 1 was lost
        executor.send(_update("a", 3, [9], "length"), _update("b", 2, [10], "length"))
        with pytest.raises(UpdatesLost):
            await readers[0]
        await readers[1]
        assert [u.token_ids for u in gapped] == [[5]]  # what came before the gap, and then the error
        assert [u.token_ids for u in whole] == [[6], [8], [10]]
        abort = await asyncio.to_thread(executor.receive)  # a's executor is told to stop it
        assert isinstance(abort, protocol.AbortRequest) and abort.request_id == "a"

    asyncio.run(_run(test))


def test_an_executor_that_could_not_deliver_a_requests_updates_ends_its_stream():
    async def test(client: ExecutorClient, executor: Executor) -> None:
        received = []
        reader = asyncio.create_task(_stream(client, executor, "a", received))
        await asyncio.to_thread(executor.receive)
        executor.send(_update("a", 0, [5]))
        error = protocol.RequestError("a", "this gateway fell behind", protocol.UNDELIVERABLE)
        executor.send_raw(protocol.encode(error))
        with pytest.raises(UpdatesLost):
            await reader
        assert [u.token_ids for u in received] == [[5]]

    asyncio.run(_run(test))


def test_an_oversized_message_is_refused_and_the_streams_on_its_connection_end_loudly():
    """ZeroMQ drops the connection that carried it, and what was queued behind it; the streams open on it end
    with UpdatesLost once what came before has been read, rather than wait on an executor that still lives."""

    async def test(client: ExecutorClient, executor: Executor) -> None:
        received = []
        reader = asyncio.create_task(_stream(client, executor, "a", received))
        await asyncio.to_thread(executor.receive)
        executor.send(_update("a", 0, [5]))
        executor.send_raw(b"\x00" * (protocol.MAX_MESSAGE_BYTES + 1))
        with pytest.raises(UpdatesLost):
            await reader
        assert [u.token_ids for u in received] == [[5]]
        assert not client.readers[executor.address].done()  # the gateway's side lives on

    asyncio.run(_run(test))
