from __future__ import annotations

import argparse

import pytest

from shared.command_line import is_loopback, open_listener_refusal, positive_int, zmq_host


def test_loopback_hosts():
    assert all(is_loopback(host) for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"))
    assert not any(is_loopback(host) for host in ("0.0.0.0", "::", "10.0.0.5", "gateway.example"))


def test_a_bound_is_a_positive_integer():
    assert positive_int("1") == 1 and positive_int("64") == 64
    for text in ("0", "-3", "2.5", "many", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="must be a positive integer"):
            positive_int(text)


def test_zmq_addresses_name_their_host_only_on_tcp():
    assert zmq_host("tcp://0.0.0.0:5600") == "0.0.0.0" and zmq_host("tcp://[::1]:5600") == "::1"
    assert zmq_host("ipc:///tmp/executor") is None and zmq_host("inproc://executor") is None


def test_a_listener_others_reach_without_credentials_is_refused_naming_the_flag():
    words = ("no credentials", "is served", "Give it some", "--allow-open")
    for host in ("127.0.0.1", "::1", "localhost", None):
        assert open_listener_refusal(f"--host {host}", host, *words) is None
    refusal = open_listener_refusal("--host 0.0.0.0", "0.0.0.0", *words)
    assert refusal is not None and "--host 0.0.0.0" in refusal and "pass --allow-open" in refusal
