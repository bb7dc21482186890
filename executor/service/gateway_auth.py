"""Which gateways an executor lets in: with CURVE keys (shared/curve_keys.py) only peers whose public key is in
its --curve-keys directory complete the handshake; everyone else gets nothing, not even an error message.

A ZAP handler (pyzmq's ThreadAuthenticator) decides on each CURVE hello, and a monitor thread watches the
ROUTER socket's handshakes so that a refused peer shows in the log with the likely cause. A peer that keeps
reconnecting (ZeroMQ retries every 100 ms) is logged once per LOG_INTERVAL_S and cause, with a count.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from shared.curve_keys import EXECUTOR, HANDSHAKE_EVENTS, CurveKeys, handshake_failure, secure_server

log = logging.getLogger("kvserve.executor.auth")

LOG_INTERVAL_S = 30.0


class RefusalLog:
    """One warning per cause per LOG_INTERVAL_S, saying how many refusals it stands for."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # the ZAP thread and the monitor thread both report here
        self.last: dict[str, float] = {}
        self.count: dict[str, int] = {}

    def refused(self, cause: str) -> None:
        with self.lock:
            self.count[cause] = self.count.get(cause, 0) + 1
            now = time.monotonic()
            if now - self.last.get(cause, -LOG_INTERVAL_S) < LOG_INTERVAL_S:
                return
            self.last[cause], times = now, self.count.pop(cause)
        log.warning("refused a ZeroMQ peer (%d time(s) since the last such line): %s", times, cause)


class _AllowedKeys:
    """The ZAP handler's credentials provider: a client's z85 public key in, allowed or not out."""

    def __init__(self, allowed: tuple[bytes, ...], refusals: RefusalLog) -> None:
        self.allowed = frozenset(allowed)
        self.refusals = refusals

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed:
            return True
        self.refusals.refused(
            f"CURVE public key {key.decode(errors='replace')} is not among the gateway keys in --curve-keys"
        )
        return False


class GatewayAuth:
    """CURVE on the executor's ROUTER socket (call before bind), with the ZAP handler and handshake monitor
    running until stop()."""

    def __init__(self, context: zmq.Context, socket: zmq.Socket, keys: CurveKeys) -> None:
        self.refusals = RefusalLog()
        self.authenticator = ThreadAuthenticator(context, log=logging.getLogger("kvserve.executor.zap"))
        self.authenticator.start()
        self.authenticator.configure_curve_callback("*", _AllowedKeys(keys.peers, self.refusals))
        secure_server(socket, keys)
        self.socket = socket
        self.monitor = socket.get_monitor_socket(HANDSHAKE_EVENTS | zmq.EVENT_MONITOR_STOPPED)
        self.thread = threading.Thread(target=self._watch, name="curve-monitor", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self.monitor)
            except zmq.ZMQError:  # the monitor socket closed: stop() or the context ended
                return
            if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                return
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                continue  # the ZAP handler has said which key it refused
            cause = handshake_failure(event["event"], event["value"], EXECUTOR)
            if cause is not None:
                self.refusals.refused(cause)

    def stop(self) -> None:
        """Before the socket closes: the monitor ends with its EVENT_MONITOR_STOPPED."""
        self.socket.disable_monitor()
        self.thread.join(timeout=1.0)
        self.monitor.close(linger=0)
        self.authenticator.stop()
