"""What the gateway's and the executor's command lines both read: bounds that are counts, whether an address
they listen on can be reached from another machine, and the refusal to serve one such without credentials."""

from __future__ import annotations

import argparse
import ipaddress


def positive_int(text: str) -> int:
    """An argparse type: a flag that bounds something is at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach host: what serves there without keys serves a developer, not the
    world. A name other than localhost may resolve to anything, so it counts as reachable."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def zmq_host(address: str) -> str | None:
    """The host of a tcp:// ZeroMQ address; None for ipc:// and inproc://, which only this machine reaches."""
    if not address.startswith("tcp://"):
        return None
    return address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")


def open_listener_refusal(
    where: str, host: str | None, without: str, exposed: str, remedy: str, flag: str
) -> str | None:
    """Fail closed: the one-line error that stops a start which would serve, without credentials, a listener
    another machine can reach; None where only this machine can (host None: not a network address). `flag` is
    the one that serves it open on purpose: the caller asks only when it was not given."""
    if host is None or is_loopback(host):
        return None
    return (
        f"{where} is not a loopback address and {without}: anyone who can reach it {exposed}. {remedy}, or "
        f"pass {flag} to serve it open on purpose"
    )
