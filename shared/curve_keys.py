"""ZeroMQ CURVE keys between gateways and executors: `kvserve curve-keys` writes them (kvserve/curve_keys_cli.py),
both sides load them here.

One directory holds zmq certificate files (zmq.auth.create_certificates' format): `executor.key` and
`executor.key_secret`, `gateway.key` and `gateway.key_secret`. An executor needs its own secret file and
authorizes every other `*.key` in the directory (several gateway identities may be allowed); a gateway needs
its own secret file and the executor's public key. A file that is missing, unreadable or not a CURVE
certificate is a CurveKeyError naming it, which the commands turn into one line and exit code 2.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

EXECUTOR = "executor"
GATEWAY = "gateway"
CURVE_KEYS_ENV = "KVSERVE_CURVE_KEYS"


class CurveKeyError(ValueError):
    """A key file that cannot serve; the message names it."""


@dataclass(frozen=True, slots=True)
class CurveKeys:
    public: bytes  # z85, 40 characters
    secret: bytes
    peers: tuple[bytes, ...]  # an executor's: the gateways it lets in; a gateway's: the executor's key


def add_curve_keys_arg(parser: argparse.ArgumentParser, role: str) -> None:
    needs = {
        EXECUTOR: "executor.key_secret; every other *.key there is a gateway it lets in",
        GATEWAY: "gateway.key_secret and executor.key",
    }[role]
    parser.add_argument(
        "--curve-keys",
        default=os.environ.get(CURVE_KEYS_ENV) or None,
        metavar="DIR",
        help=f"ZeroMQ CURVE keys from `kvserve curve-keys` ({needs}); default: ${CURVE_KEYS_ENV}; "
        "without keys executors take requests from anyone who reaches their port",
    )


def _read(path: Path, want_secret: bool) -> tuple[bytes, bytes | None]:
    """(public, secret) of one certificate file, each checked to be a 32-byte key in z85."""
    try:
        with path.open("rb"):  # zmq.auth says only "Invalid certificate file", whatever the reason
            pass
        public, secret = zmq.auth.load_certificate(path)
    except OSError as error:
        raise CurveKeyError(f"{path}: cannot read it: {error.strerror or error}") from None
    except ValueError:
        raise CurveKeyError(f"{path}: not a zmq CURVE certificate (no public-key line)") from None
    if want_secret and secret is None:
        raise CurveKeyError(f"{path}: no secret-key in it (is it the public .key file?)")
    for kind, key in (("public-key", public), ("secret-key", secret)):
        if key is not None and not _is_z85_key(key):
            raise CurveKeyError(f"{path}: its {kind} is not a 40-character z85 CURVE key")
    if secret is not None and zmq.curve_public(secret) != public:
        raise CurveKeyError(f"{path}: its public-key does not belong to its secret-key")
    return public, secret


def _is_z85_key(key: bytes) -> bool:
    try:
        return len(key) == 40 and len(z85.decode(key)) == 32
    except (ValueError, KeyError, TypeError):
        return False


def _own(directory: Path, name: str) -> tuple[bytes, bytes]:
    public, secret = _read(directory / f"{name}.key_secret", want_secret=True)
    assert secret is not None
    return public, secret


def load_executor_keys(directory: str | Path) -> CurveKeys:
    """The executor's own pair and the public keys it authorizes: every *.key in directory but its own."""
    directory = Path(directory)
    public, secret = _own(directory, EXECUTOR)
    peers = tuple(
        _read(path, want_secret=False)[0]
        for path in sorted(directory.glob("*.key"))
        if path.name != f"{EXECUTOR}.key"
    )
    if not peers:
        missing = directory / f"{GATEWAY}.key"
        raise CurveKeyError(f"{missing}: missing, and no other *.key there: no gateway to authorize")
    return CurveKeys(public, secret, tuple(p for p in peers if p != public))


def load_gateway_keys(directory: str | Path) -> CurveKeys:
    """The gateway's own pair and the executor's public key it expects to find at the other end."""
    directory = Path(directory)
    public, secret = _own(directory, GATEWAY)
    executor_public, _ = _read(directory / f"{EXECUTOR}.key", want_secret=False)
    return CurveKeys(public, secret, (executor_public,))


def secure_server(socket: zmq.Socket, keys: CurveKeys) -> None:
    """Before bind: the socket speaks CURVE as a server; who may connect is the ZAP handler's call."""
    socket.curve_secretkey = keys.secret
    socket.curve_publickey = keys.public
    socket.curve_server = True


def secure_client(socket: zmq.Socket, keys: CurveKeys) -> None:
    """Before connect: CURVE as a client of the executor whose public key keys.peers[0] is."""
    socket.curve_secretkey = keys.secret
    socket.curve_publickey = keys.public
    socket.curve_serverkey = keys.peers[0]


# the handshake events a monitor socket reports, and what each most likely means, for the log and /health
HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


# what a gateway with keys sees when the executor closes without a word: it does so when our hello does not
# decrypt under its secret key, and sometimes (a race) when it has no keys at all, which a later retry tells
DROPPED = (
    "the executor dropped the CURVE handshake: its public key is not the executor.key this gateway holds "
    "(keys from another `kvserve curve-keys` run?), or it has no keys"
)


def handshake_failure(event: int, value: int, side: str, keyed: bool = True) -> str | None:
    """Why a handshake failed, as far as ZeroMQ tells; None for a success. side: who saw it (GATEWAY or
    EXECUTOR); keyed: whether that side has CURVE keys. Which event a mismatch gives is a race (the side
    that closes first may leave the other only a broken pipe), so what the side knows of itself comes first."""
    if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
        return None
    mismatch = (
        event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
    )
    if side == GATEWAY:
        if not keyed:
            return "the executor requires CURVE keys and this gateway has none: start it with --curve-keys"
        if mismatch:
            return "the executor has no CURVE keys and this gateway has: start both with --curve-keys, or neither"
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return (
                f"the executor refused this gateway's CURVE key (ZAP status {value}): its --curve-keys "
                "directory lacks this gateway's public key (gateway.key)"
            )
        return DROPPED
    if mismatch:
        return "a peer without CURVE keys tried to connect"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return "a peer's CURVE hello did not decrypt: it holds another executor public key (executor.key)"
    return f"a peer broke off the handshake (ZeroMQ event {event}, value {value}): most likely it has no CURVE keys"
