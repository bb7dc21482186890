"""What the gateway's and the executor's command lines both read: bounds that are counts, and whether an address
they listen on can be reached from another machine."""

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
