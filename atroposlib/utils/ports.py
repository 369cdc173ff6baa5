"""A free local TCP port, for starting servers on loopback (launcher, benchmarks, tests)."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it; another process may take it
    before it is bound again, which callers starting a server retry or accept)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
