"""A client that pipelines requests and never reads the answers, and the check that a server
it floods grows by little."""

from __future__ import annotations

import socket
import time

import httpx
import psutil


def flood(port: int, path: str, requests: int = 200_000, seconds: float = 6.0) -> socket.socket:
    """Pipeline ``requests`` GETs of ``path`` on one socket without reading; stop when the
    server stops reading (or after ``seconds``). The socket is left open."""
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    data = memoryview(request * requests)
    sent, deadline = 0, time.monotonic() + seconds
    while sent < len(data) and time.monotonic() < deadline:
        try:
            sent += sock.send(data[sent : sent + 65536])
        except BlockingIOError:
            time.sleep(0.01)
    return sock


def assert_flood_grows_server_little(
    port: int, pid: int, path: str, health: str = "/health", limit_mb: float = 64
) -> None:
    """Flood ``path`` on one connection; the server process ``pid`` must grow by less than
    ``limit_mb`` and keep answering ``health`` on another connection."""
    server = psutil.Process(pid)
    before = server.memory_info().rss
    sock = flood(port, path)
    time.sleep(1)
    grown = (server.memory_info().rss - before) / 2**20
    sock.close()
    assert grown < limit_mb, f"the server grew by {grown:.0f} MB"
    assert httpx.get(f"http://127.0.0.1:{port}{health}", timeout=30).status_code == 200
