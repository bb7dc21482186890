"""ZeroMQ DEALER connections from the gateway to executors: requests out, per-step updates back, routed by
request id to the stream that waits for them.

Each connection's handshakes are watched (a monitor socket): an executor that refuses this gateway (CURVE keys
missing on one side, or of another pair) is logged once with the likely cause, is not routed to, and shows as
refused in /health; requests sent to it meanwhile go elsewhere. It comes back at its next handshake that
succeeds.

A stream is exact or ends loudly: each request's updates are numbered, and an update that does not follow the
last, the executor saying it could not deliver them (this gateway fell too far behind), or the connection
breaking (what was queued on it is gone; a message over MAX_MESSAGE_BYTES breaks it too) ends the request with
UpdatesLost, which is handled as a lost executor is."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from gateway.routing.owed_usage import OwedUsage
from shared import protocol
from shared.curve_keys import DROPPED, GATEWAY, HANDSHAKE_EVENTS, CurveKeys, handshake_failure, secure_client
from shared.tenant import Tenant

log = logging.getLogger("kvserve.gateway")

LIVENESS_CHECK_S = 1.0  # how long to wait for an update before asking Redis whether the executor still lives
# an executor is gone when Redis says so this many checks in a row (two seconds and more, a heartbeat's
# expiry is five): a Redis that restarted empty holds no registration until the executor's next heartbeat
# (HEARTBEAT_INTERVAL_S), and the requests it is running meanwhile must not be given up
LIVENESS_MISSES = 3


class ExecutorRequestError(Exception):
    """The executor refused or failed a request (code is HTTP-like: 400, 503, 500)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class ExecutorGone(Exception):
    """The executor stopped answering: its heartbeat expired in Redis."""

    why = "stopped answering"


class UpdatesLost(ExecutorGone):
    """Some of the request's updates never arrived: what it streamed cannot be completed as generated."""

    why = "lost updates of this request on the way (this gateway fell behind reading them)"


@dataclass(slots=True)
class ExecutorTiming:
    """time.monotonic() when the request left for the executor, and when its first token came back off the
    socket: the span between is the executor's (and the wire's) share of time to first token."""

    sent: float | None = None
    first_token: float | None = None

    @property
    def executor_ttft(self) -> float | None:
        if self.sent is None or self.first_token is None:
            return None
        return self.first_token - self.sent


class ExecutorClient:
    def __init__(self, curve: CurveKeys | None = None) -> None:
        self.context = zmq.asyncio.Context()
        self.curve = curve
        self.sockets: dict[str, zmq.asyncio.Socket] = {}
        self.readers: dict[str, asyncio.Task] = {}
        self.monitors: dict[str, tuple[asyncio.Task, zmq.asyncio.Socket]] = {}
        self.heartbeats: dict[str, asyncio.Task] = {}  # tell each executor this gateway still reads
        # executor address -> why its last handshake failed; gone once one succeeds
        self.refused: dict[str, str] = {}
        self.handshaken: dict[str, asyncio.Event] = {}  # set once a handshake has succeeded or failed
        self.streams: dict[str, asyncio.Queue] = {}
        # the executor each open request was sent to: a request re-sent elsewhere must not take updates from
        # the one it left (a stopped executor that resumes still answers what it had queued)
        self.sent_to: dict[str, str] = {}
        # requests sent to each executor that it has not answered yet (no update, no refusal): until it does,
        # its published load may not count them, so the router counts them here
        self.awaiting: set[str] = set()
        self.unanswered: Counter[str] = Counter()
        # the same per (executor address, tenant): an executor's waiting places are per tenant
        self.unanswered_of_tenant: Counter[tuple[str, Tenant]] = Counter()
        self.tenant_of: dict[str, Tenant] = {}  # request id -> its tenant, while awaiting
        self.started: set[str] = set()  # request ids whose stream has had an update
        self.next_seq: dict[str, int] = {}  # request id -> the seq its next update must have
        self.owed = OwedUsage()  # what the executors will say the KV of requests this gateway aborted held

    def _socket(self, address: str) -> zmq.asyncio.Socket:
        socket = self.sockets.get(address)
        if socket is None:
            socket = self.context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
            if self.curve is not None:
                secure_client(socket, self.curve)
            monitor = socket.get_monitor_socket(HANDSHAKE_EVENTS | zmq.EVENT_DISCONNECTED)
            self.handshaken[address] = asyncio.Event()
            socket.connect(address)
            self.sockets[address] = socket
            loop = asyncio.get_running_loop()
            self.readers[address] = loop.create_task(self._read(address, socket))
            self.monitors[address] = (loop.create_task(self._watch(address, monitor)), monitor)
            self.heartbeats[address] = loop.create_task(self._heartbeat(address))
        return socket

    async def handshake(self, address: str, wait_s: float) -> str | None:
        """Connect if not yet connected and wait up to wait_s for the first handshake's outcome: why the
        executor refused this gateway, or None (accepted, or not known yet: it may still be starting)."""
        self._socket(address)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.handshaken[address].wait(), wait_s)
        return self.refused.get(address)

    async def _watch(self, address: str, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    await self._disconnected(address)
                else:
                    self._handshake_event(address, event["event"], event["value"])
        except (zmq.ZMQError, asyncio.CancelledError):
            return

    async def _disconnected(self, address: str) -> None:
        """The connection to the executor broke (it died, or sent a message over MAX_MESSAGE_BYTES): what it had
        queued on it is lost, and the executor drops what it sends meanwhile, so the streams still open there
        end now, once what did arrive has been read."""
        socket = self.sockets[address]
        for _ in range(100):  # a second at most: a connection made again may keep it busy
            if not await socket.poll(0, zmq.POLLIN):
                break
            await asyncio.sleep(0.01)  # the reader's turn
        await asyncio.sleep(0)
        for request_id, sent_to in list(self.sent_to.items()):
            if sent_to == address and request_id in self.streams and request_id in self.next_seq:
                del self.next_seq[request_id]  # one error, which ends the stream; nothing after it is read
                self.streams[request_id].put_nowait(UpdatesLost(address))

    def _handshake_event(self, address: str, event: int, value: int) -> None:
        cause = handshake_failure(event, value, GATEWAY, keyed=self.curve is not None)
        self.handshaken[address].set()
        if cause is None:
            if self.refused.pop(address, None) is not None:
                log.info("executor %s accepts this gateway now (ZeroMQ handshake succeeded)", address)
            return
        known = self.refused.get(address)
        if known is not None and cause == DROPPED:
            cause = known  # a retry that tells less than the last: keep what is known
        if known != cause:  # ZeroMQ retries every 100 ms: log what changes, not each retry
            log.error("executor %s refused this gateway's connection: %s", address, cause)
        self.refused[address] = cause
        # what waits there would wait forever: ZeroMQ holds it until a handshake succeeds. It goes elsewhere.
        for request_id, sent_to in list(self.sent_to.items()):
            if sent_to == address and request_id in self.awaiting and request_id in self.streams:
                self.streams[request_id].put_nowait(ExecutorGone(address))

    async def _heartbeat(self, address: str) -> None:
        """Without these the executor would run this gateway's requests to their end after it died."""
        while True:
            with contextlib.suppress(zmq.ZMQError):  # not connected: nothing of this gateway runs there
                await self._send(address, protocol.GatewayHeartbeat())
            await asyncio.sleep(protocol.GATEWAY_HEARTBEAT_S)

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
                received = time.monotonic()  # before the update waits in a queue: that wait is the gateway's
                # first tokens first: streams wake in the order their queues are fed, and a request still
                # waiting for its first token should not wait behind every running stream's next chunk
                for update in sorted(msg.outputs, key=lambda u: u.request_id in self.started):
                    queue = self._stream(address, update.request_id)
                    if queue is not None:
                        if self._in_sequence(address, update, queue):
                            queue.put_nowait((received, update))
                            if not protocol.is_acceptance(update):
                                self.started.add(update.request_id)
                            self._answered(update.request_id)
                    elif update.kv_block_seconds is not None:
                        self.owed.told(address, update.request_id, update.kv_block_seconds)
            elif isinstance(msg, protocol.RequestError):
                queue = self._stream(address, msg.request_id)
                if queue is not None:
                    if msg.code == protocol.UNDELIVERABLE:
                        log.error("request %s: executor %s says: %s", msg.request_id, address, msg.message)
                        queue.put_nowait(UpdatesLost(address))
                    else:
                        queue.put_nowait(ExecutorRequestError(msg.message, msg.code))
                    self._answered(msg.request_id)

    def _in_sequence(self, address: str, update: protocol.RequestUpdate, queue: asyncio.Queue) -> bool:
        """Whether the update is the one its stream expects next; the first that is not ends the stream."""
        request_id = update.request_id
        expected = self.next_seq.get(request_id)
        if expected is None:  # its stream has already been ended by a gap
            return False
        if update.seq != expected:
            log.error(
                "request %s: update %d from executor %s where %d was next: updates were lost on the way",
                request_id,
                update.seq,
                address,
                expected,
            )
            del self.next_seq[request_id]
            queue.put_nowait(UpdatesLost(address))
            self._answered(request_id)
            return False
        self.next_seq[request_id] = expected + 1
        return True

    def _stream(self, address: str, request_id: str) -> asyncio.Queue | None:
        """The queue waiting for a request's messages from this executor, if any."""
        if self.sent_to.get(request_id) != address:
            return None
        return self.streams.get(request_id)

    async def submit(
        self, address: str, request: protocol.GenerateRequest, timing: ExecutorTiming | None = None
    ) -> None:
        """Send the request now; its updates wait in a queue for `updates`. The caller must end with `updates`
        or `release`, so the executor never runs a request nobody reads. timing, when given, records when
        the request left (and, through `updates`, when its first token came back)."""
        self.streams[request.request_id] = asyncio.Queue()
        self.sent_to[request.request_id] = address
        self.next_seq[request.request_id] = 0  # a request sent again elsewhere starts again from 0
        self.awaiting.add(request.request_id)
        self.unanswered[address] += 1
        self.unanswered_of_tenant[address, request.tenant] += 1
        self.tenant_of[request.request_id] = request.tenant
        try:
            await self._send(address, request)
        except zmq.Again:
            self._forget(request.request_id)
            why = self.refused.get(address, "nothing it sends can be queued")
            raise ExecutorRequestError(f"the executor at {address} cannot be reached: {why}", 503) from None
        except BaseException:
            self._forget(request.request_id)
            raise
        if timing is not None:
            timing.sent, timing.first_token = time.monotonic(), None

    async def updates(
        self,
        address: str,
        request_id: str,
        is_alive: Callable[[], Awaitable[bool]],
        timing: ExecutorTiming | None = None,
        num_choices: int = 1,
    ) -> AsyncIterator[protocol.RequestUpdate]:
        """A submitted request's updates until it finishes (each of its num_choices has had its finish reason).
        Leaving early (a client that went away, a stop string matched) aborts it on the executor, so its
        blocks are freed. While no update comes, is_alive is asked every LIVENESS_CHECK_S; an executor gone
        LIVENESS_MISSES times in a row raises ExecutorGone."""
        queue = self.streams[request_id]
        misses = 0
        finished: set[int] = set()
        try:
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), LIVENESS_CHECK_S)
                except TimeoutError:
                    misses = 0 if await is_alive() else misses + 1
                    if misses >= LIVENESS_MISSES:
                        # the abort sent on the way out still matters if it was only slow, not dead
                        raise ExecutorGone(address) from None
                    continue
                if isinstance(item, ExecutorRequestError):
                    self._forget(request_id)  # refused: nothing runs there
                    raise item
                if isinstance(item, ExecutorGone):  # it refused this gateway's connection
                    raise item
                received, item = item
                if item.token_ids and timing is not None and timing.first_token is None:
                    timing.first_token = received
                if item.finish_reason is not None:
                    finished.add(item.index)
                done = len(finished) >= num_choices
                if done:
                    self._forget(request_id)
                yield item
                if done:
                    return
        finally:
            await self.release(address, request_id)

    async def release(self, address: str, request_id: str) -> None:
        """Done with a request in whatever state: forget it, and abort it on the executor if it still runs
        (what its KV held is then owed: `owed_kv_block_seconds`)."""
        queue = self.streams.get(request_id)
        if self._forget(request_id):
            # its last update may be here already, never read
            self.owed.owe(address, request_id, _unread_kv_block_seconds(queue))
            await self.abort(address, request_id)

    def owed_kv_block_seconds(self, request_id: str) -> asyncio.Future[float | None] | None:
        """For a request this gateway aborted: the KV block-seconds its executor says it held (OwedUsage.of)."""
        return self.owed.of(request_id)

    def _forget(self, request_id: str) -> bool:
        """Whether the request was still open."""
        self._answered(request_id)
        self.started.discard(request_id)
        self.next_seq.pop(request_id, None)
        self.sent_to.pop(request_id, None)
        return self.streams.pop(request_id, None) is not None

    def _answered(self, request_id: str) -> None:
        if request_id in self.awaiting:
            self.awaiting.discard(request_id)
            address = self.sent_to[request_id]
            self.unanswered[address] -= 1
            key = (address, self.tenant_of.pop(request_id))
            self.unanswered_of_tenant[key] -= 1
            if not self.unanswered_of_tenant[key]:
                del self.unanswered_of_tenant[key]  # tenants come and go: keep only those with requests out

    async def abort(self, address: str, request_id: str, index: int | None = None) -> None:
        """Stop the request on the executor: every choice of it, or only choice index."""
        try:
            await self._send(address, protocol.AbortRequest(request_id, index))
        except zmq.Again:  # no connection to queue it on: the request never got there either
            log.debug("no abort for %s: %s has no connection to send it on", request_id, address)
        except zmq.ZMQError as error:
            log.warning("could not send abort for %s to %s: %s", request_id, address, error)

    async def _send(self, address: str, msg: protocol.Message) -> None:
        """Queue a message without waiting: a DEALER with no connection (ZeroMQ drops it after the executor
        refused the handshake) would otherwise hold the send, and the request, forever. zmq.Again then."""
        await self._socket(address).send(protocol.encode(msg), zmq.NOBLOCK)

    async def close(self) -> None:
        for task in [
            *self.readers.values(),
            *self.heartbeats.values(),
            *(t for t, _ in self.monitors.values()),
        ]:
            task.cancel()
        for _, monitor in self.monitors.values():
            monitor.close(linger=0)  # an open monitor socket would hold context.term() forever
        for socket in self.sockets.values():
            socket.close(linger=0)
        self.context.term()


def _unread_kv_block_seconds(queue: asyncio.Queue) -> float | None:
    """What a request's last update says its KV held, if that update waits unread in the queue."""
    while not queue.empty():
        item = queue.get_nowait()
        if isinstance(item, tuple) and item[1].kv_block_seconds is not None:
            return item[1].kv_block_seconds
    return None
