"""Local TCP ports: a free one for starting servers on loopback (launcher, benchmarks, tests),
and the check a server makes before it loads anything, so that a busy port is one line
naming the flag to change rather than uvicorn's bind error after a long start."""

from __future__ import annotations

import errno
import socket

__all__ = ["busy_port_message", "free_port", "next_free_port", "port_in_use"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it; another process may take it
    before it is bound again, which callers starting a server retry or accept)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    """Whether binding ``host:port`` fails because something listens there (as uvicorn binds:
    ``SO_REUSEADDR``, so a port in TIME_WAIT after a server stopped counts as free). Port 0
    (any free port) is never in use; other bind errors (no such address) are the server's
    to report."""
    if port == 0:
        return False
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def next_free_port(host: str, start: int, tries: int = 50) -> int:
    """The first port from ``start + 1`` on that ``host`` can bind now (an easy number to
    type), else any free one."""
    for port in range(start + 1, min(start + 1 + tries, 65536)):
        if not port_in_use(host, port):
            return port
    return free_port()


def busy_port_message(host: str, port: int, flag: str, any_port: bool = False) -> str | None:
    """``"port 8000 on 127.0.0.1 is in use ...; pass --port 8001 (free now)"`` when
    ``host:port`` is taken, else None. ``flag`` is how the user sets the port (``--port``,
    ``--api-port``); ``any_port`` adds ``or FLAG 0`` where 0 means "pick a free one"."""
    if not port_in_use(host, port):
        return None
    hint = f"pass {flag} {next_free_port(host, port)} (free now)"
    if any_port:
        hint += f" or {flag} 0 (any free port)"
    return f"port {port} on {host} is in use (another server, perhaps another user's); {hint}"
