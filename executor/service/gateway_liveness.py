"""Which gateways still read the updates of the requests they sent: a gateway that died (SIGKILL, its host gone)
never says so, and its requests would generate to max_tokens for nobody, holding KV blocks and batch places.

A gateway that sends heartbeats (protocol.GatewayHeartbeat) is timed out once nothing at all has come from it for
GATEWAY_SILENCE_S; one that never sent a heartbeat (an older gateway, a test's bare socket) never is. Reading
the socket is the executor loop's first act each step, so a long engine step does not make a live gateway look
silent: its heartbeats wait in ZeroMQ's queue and count when read.
"""

from __future__ import annotations

from shared.protocol import GATEWAY_SILENCE_S


class GatewayLiveness:
    def __init__(self, silence_s: float = GATEWAY_SILENCE_S) -> None:
        self.silence_s = silence_s
        # ZeroMQ identity -> time.monotonic(), heartbeating gateways only
        self.last_heard: dict[bytes, float] = {}

    def heard(self, identity: bytes, now: float, heartbeat: bool) -> None:
        """Any message is a sign of life; a heartbeat also starts the clock for a gateway not yet timed."""
        if heartbeat or identity in self.last_heard:
            self.last_heard[identity] = now

    def gone(self, now: float) -> list[bytes]:
        """Gateways silent for silence_s, each reported once (one that speaks again is timed again)."""
        silent = [identity for identity, heard in self.last_heard.items() if now - heard > self.silence_s]
        for identity in silent:
            del self.last_heard[identity]
        return silent
