"""HTTP/1.1 written by hand over one socket: what httpx hides (pipelined requests on one keep-alive connection,
a body cut short), for tests that need to see the connection itself."""

from __future__ import annotations

import socket


def request(
    method: str,
    path: str,
    body: bytes = b"",
    content_type: str | None = "application/json",
    *,
    close=False,
    headers: dict[str, str] | None = None,
):
    """One request's bytes; `close` asks the server to close the connection after answering it."""
    head = [f"{method} {path} HTTP/1.1", "host: 127.0.0.1", f"content-length: {len(body)}"]
    if content_type is not None:
        head.append(f"content-type: {content_type}")
    if close:
        head.append("connection: close")
    head += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def pipelined(port: int, requests: list[bytes], timeout: float = 60) -> list[tuple[int, bytes]]:
    """The requests written at once on one connection (the last should `close`), and (status, body) of every
    response the server sent before closing it: a server that drops the connection early answers fewer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(b"".join(requests))
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    responses = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        length = int(headers.get("content-length", 0))
        responses.append((int(lines[0].split()[1]), rest[:length]))
        data = rest[length:]
    return responses
