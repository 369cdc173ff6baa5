"""Clients that hold a request body open without finishing it, for body-timeout tests.

Each opens a real socket to a server on loopback and sends a ``POST``'s head and
part of its body (or none), then goes idle: the uploads that must neither starve
honest clients nor be kept forever.
"""

from __future__ import annotations

import socket
import time

HUGE = 268_435_455
"""A declared length just under run-api's default 256 MiB bound (the issue's reproduction)."""


def stalled_upload(
    port: int, path: str, declared: int, sent: bytes = b"{", headers: str = ""
) -> socket.socket:
    """A socket that declared ``declared`` body bytes for ``POST path``, sent ``sent``, and idles."""
    sock = socket.create_connection(("127.0.0.1", port))
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"{headers}Content-Length: {declared}\r\n\r\n"
    )
    sock.sendall(head.encode() + sent)
    return sock


def stalled_uploads(port: int, path: str, huge: int = HUGE, partial: bytes = b"") -> list:
    """The three kinds: two huge-length liars with one byte each, one idle head, one partial body."""
    socks = [stalled_upload(port, path, huge), stalled_upload(port, path, huge)]
    socks.append(stalled_upload(port, path, 1000, b""))
    if partial:
        socks.append(stalled_upload(port, path, len(partial) * 2, partial))
    return socks


def answer_of(sock: socket.socket, timeout: float = 30.0) -> bytes:
    """Everything the server writes to ``sock`` until it closes it or ``timeout`` passes."""
    sock.settimeout(0.5)
    data = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            if data.startswith(b"HTTP/1.1") and b"\r\n\r\n" in data:
                return data
            continue
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data
