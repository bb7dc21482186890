"""What the executor sends its gateways, delivered whole or ended loudly, never dropped in silence.

The ROUTER socket is ROUTER_MANDATORY: a send ZeroMQ cannot queue (the gateway's pipe is at ZMQ_SNDHWM because
it falls behind reading, or it is not connected at all) raises instead of dropping the message. A send never
waits either (NOBLOCK): one slow gateway must not stall the engine loop, nor the other gateways' streams. What
cannot be sent yet waits here, in order, per gateway, and goes first at the next flush. Past max_unsent step
messages the service gives up on that gateway's requests (`behind`, `drop`): their blocks are freed and each
ends with an UNDELIVERABLE error, which reaches the gateway after everything sent before it.
"""

from __future__ import annotations

import errno
import logging
from collections import defaultdict, deque

import zmq

from shared import protocol

log = logging.getLogger("kvserve.executor")

DEFAULT_SNDHWM = 1000  # ZeroMQ's own default


def configure_router(socket: zmq.Socket, sndhwm: int) -> None:
    """Before bind: sends that fail loudly, sndhwm messages queued per gateway, no message over the protocol's
    bound accepted (a larger one disconnects its sender)."""
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    socket.setsockopt(zmq.SNDHWM, sndhwm)
    socket.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)


class GatewayOutbox:
    def __init__(self, socket: zmq.Socket, max_unsent: int) -> None:
        self.socket = socket
        self.max_unsent = max_unsent  # step messages held per gateway beyond ZeroMQ's queue
        self.unsent: dict[bytes, deque[tuple[protocol.Message, bytes]]] = {}  # (message, its encoding)
        self.unsent_steps: defaultdict[bytes, int] = defaultdict(int)
        self.gone: set[bytes] = set()  # gateways ZeroMQ no longer knows (disconnected): nothing reaches them
        self.oversized: defaultdict[bytes, set[str]] = defaultdict(set)  # requests whose update was too large

    def send(self, identity: bytes, msg: protocol.Message, payload: bytes | None = None) -> None:
        """Now if ZeroMQ takes it, else after what already waits for that gateway. payload: msg encoded."""
        payload = protocol.encode(msg) if payload is None else payload
        waiting = self.unsent.get(identity)
        if waiting is None and self._send_now(identity, payload):
            return
        if identity in self.gone:
            return
        if waiting is None:
            log.info("gateway %s is not reading fast enough: holding its updates here", identity.hex())
        self.unsent.setdefault(identity, deque()).append((msg, payload))
        self.unsent_steps[identity] += isinstance(msg, protocol.StepBatch)

    def send_updates(self, identity: bytes, updates: list[protocol.RequestUpdate]) -> None:
        """One StepBatch, or several if one would pass MAX_MESSAGE_BYTES; an update too large alone is not sent
        and its request is noted in `oversized`."""
        batch = protocol.StepBatch(updates)
        payload = protocol.encode(batch)
        if len(payload) <= protocol.MAX_MESSAGE_BYTES:
            self.send(identity, batch, payload)
            return
        for update in updates:
            single = protocol.StepBatch([update])
            payload = protocol.encode(single)
            if len(payload) <= protocol.MAX_MESSAGE_BYTES:
                self.send(identity, single, payload)
            else:
                self.oversized[identity].add(update.request_id)

    def retry(self) -> None:
        """Send what waits, oldest first, until a gateway's pipe is full again."""
        for identity in list(self.unsent):
            waiting = self.unsent[identity]
            while waiting and self._send_now(identity, waiting[0][1]):
                sent, _ = waiting.popleft()
                self.unsent_steps[identity] -= isinstance(sent, protocol.StepBatch)
            if not waiting:
                log.info("gateway %s caught up: every update held for it has been sent", identity.hex())
            if not waiting or identity in self.gone:
                self._forget(identity)

    def behind(self) -> list[bytes]:
        """Gateways that have more than max_unsent step messages waiting here."""
        return [identity for identity, steps in self.unsent_steps.items() if steps > self.max_unsent]

    def drop(self, identity: bytes) -> set[str]:
        """Give up that gateway's waiting step messages (errors stay queued); the requests they were for."""
        waiting = self.unsent.get(identity, deque())
        kept = deque(entry for entry in waiting if not isinstance(entry[0], protocol.StepBatch))
        dropped = {
            u.request_id for msg, _ in waiting if isinstance(msg, protocol.StepBatch) for u in msg.outputs
        }
        self._forget(identity)
        if kept:
            self.unsent[identity] = kept
        return dropped

    def _send_now(self, identity: bytes, payload: bytes) -> bool:
        try:
            self.socket.send_multipart([identity, payload], zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as error:
            if error.errno != errno.EHOSTUNREACH:
                raise
            self.gone.add(identity)
            return False
        self.gone.discard(identity)
        return True

    def _forget(self, identity: bytes) -> None:
        self.unsent.pop(identity, None)
        self.unsent_steps.pop(identity, None)
