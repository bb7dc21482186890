"""The executor's sends to its gateways over a real ROUTER: never blocking, never dropping in silence."""

from __future__ import annotations

import time

import zmq

from executor.service.gateway_outbox import GatewayOutbox, configure_router
from shared import protocol

FILLER = [7] * 2000  # an update large enough that ZeroMQ's and the kernel's buffers fill in a few hundred


def _pair(context: zmq.Context) -> tuple[zmq.Socket, zmq.Socket, bytes]:
    """(executor ROUTER with a high-water mark of 2, gateway DEALER that reads only when told, its identity)."""
    router = context.socket(zmq.ROUTER)
    configure_router(router, 2)
    router.setsockopt(zmq.SNDBUF, 4096)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVHWM, 2)
    dealer.setsockopt(zmq.RCVBUF, 4096)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send(b"hello")
    identity, _ = router.recv_multipart()
    return router, dealer, identity


def _update(seq: int) -> protocol.RequestUpdate:
    return protocol.RequestUpdate("a", FILLER, None, None, 0, seq=seq)


def test_a_gateway_that_does_not_read_gets_everything_in_order_once_it_does():
    context = zmq.Context()
    router, dealer, identity = _pair(context)
    try:
        outbox = GatewayOutbox(router, max_unsent=10_000)
        started = time.monotonic()
        for seq in range(200):
            outbox.retry()
            outbox.send_updates(identity, [_update(seq)])
        assert time.monotonic() - started < 5  # no send waited on the stalled gateway
        assert outbox.unsent_steps[identity] > 0  # its pipe filled: ZeroMQ would have dropped these
        received = []
        while len(received) < 200:
            outbox.retry()
            if dealer.poll(10):
                received += [u.seq for u in protocol.decode(dealer.recv()).outputs]
        assert received == list(range(200))
        assert not outbox.unsent and not outbox.behind()
    finally:
        context.destroy(linger=0)


def test_past_its_bound_a_gateway_is_behind_and_what_waits_is_given_up_with_the_requests_it_carried():
    context = zmq.Context()
    router, dealer, identity = _pair(context)
    try:
        outbox = GatewayOutbox(router, max_unsent=5)
        for seq in range(200):
            outbox.send_updates(identity, [_update(seq)])
            if outbox.behind():
                break
        assert outbox.behind() == [identity]
        outbox.send(identity, protocol.RequestError("a", "lost", protocol.UNDELIVERABLE))
        assert outbox.drop(identity) == {"a"}
        kept = [
            msg for msg, _ in outbox.unsent[identity]
        ]  # the error still goes out, after what ZeroMQ holds
        assert not outbox.behind() and kept == [protocol.RequestError("a", "lost", protocol.UNDELIVERABLE)]
        messages = []
        while not messages or not isinstance(messages[-1], protocol.RequestError):
            outbox.retry()
            if dealer.poll(10):
                messages.append(protocol.decode(dealer.recv()))
        seqs = [u.seq for m in messages[:-1] for u in m.outputs]
        assert seqs == list(range(len(seqs)))  # a run from the start, then the error: a gap is never silent
    finally:
        context.destroy(linger=0)


def test_a_gateway_that_is_not_connected_is_reported_gone_not_queued_for():
    context = zmq.Context()
    router, dealer, identity = _pair(context)
    try:
        outbox = GatewayOutbox(router, max_unsent=5)
        outbox.send_updates(b"no such gateway", [_update(0)])
        assert outbox.gone == {b"no such gateway"} and not outbox.unsent
    finally:
        context.destroy(linger=0)
