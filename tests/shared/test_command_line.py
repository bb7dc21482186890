from __future__ import annotations

import argparse

import pytest

from shared.command_line import is_loopback, positive_int


def test_loopback_hosts():
    assert all(is_loopback(host) for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"))
    assert not any(is_loopback(host) for host in ("0.0.0.0", "::", "10.0.0.5", "gateway.example"))


def test_a_bound_is_a_positive_integer():
    assert positive_int("1") == 1 and positive_int("64") == 64
    for text in ("0", "-3", "2.5", "many", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="must be a positive integer"):
            positive_int(text)
