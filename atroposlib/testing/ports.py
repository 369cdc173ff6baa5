"""Free loopback ports, and starting a server on one when another process may take it first.

``free_port()`` asks the OS for a port that is free now and closes it again; between that and
the server's own ``bind`` another process (a parallel test, another server starting) can take
it. ``start_on_free_port`` closes that race: it starts the server, and when the server exits
because its port was taken, picks another port and starts it again.

Example::

    proc, port = start_on_free_port(
        lambda port: run_api_cmd(port), health_path="/health", log_path=tmp_path / "api.log"
    )
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Callable, Mapping, Sequence

from atroposlib.testing.processes import start_process, stop_process, wait_http
from atroposlib.utils.ports import free_port

__all__ = ["PortTaken", "free_port", "port_was_taken", "start_on_free_port"]

_TAKEN_MARKERS = ("address already in use", "errno 98", "eaddrinuse", "errno 48")
"""How a server's output says its port was taken (Linux errno 98, macOS errno 48)."""


class PortTaken(RuntimeError):
    """Every port tried was taken by another process before the server could bind it."""


def port_was_taken(output: str) -> bool:
    """Whether a server's output says it could not bind because the address is in use."""
    lowered = output.lower()
    return any(marker in lowered for marker in _TAKEN_MARKERS)


def start_on_free_port(
    make_cmd: Callable[[int], Sequence[str]],
    health_path: str = "/health",
    log_path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
    attempts: int = 5,
    pick_port: Callable[[], int] = free_port,
    health_headers: Mapping[str, str] | None = None,
) -> tuple[subprocess.Popen, int]:
    """Start ``make_cmd(port)`` on a free port and wait until ``health_path`` answers.

    When the process exits before answering and its output says the port was taken, another
    port is tried (up to ``attempts`` in all; then :class:`PortTaken`). Any other early exit or
    a timeout raises at once, with the end of the log. The output goes to ``log_path`` (a
    temporary file when none is given, since the output is what tells a taken port apart).
    Returns the running process and its port; the caller stops it (``stop_process``).
    """
    import tempfile

    own_log = log_path is None
    if own_log:
        handle = tempfile.NamedTemporaryFile(prefix="server-", suffix=".log", delete=False)
        handle.close()
        log_path = handle.name
    log = Path(log_path)
    tried: list[int] = []
    try:
        for _ in range(attempts):
            port = pick_port()
            tried.append(port)
            start_at = log.stat().st_size if log.exists() else 0
            proc = start_process(make_cmd(port), log_path=log, env=env)
            try:
                wait_http(
                    f"http://127.0.0.1:{port}{health_path}",
                    timeout=timeout,
                    proc=proc,
                    headers=health_headers,
                )
                return proc, port
            except RuntimeError:  # the process exited before answering
                stop_process(proc)
                with open(log, "rb") as f:
                    f.seek(start_at)
                    output = f.read().decode(errors="replace")
                if port_was_taken(output):
                    continue
                raise RuntimeError(
                    f"server on port {port} exited with code {proc.returncode}: {output[-4000:]}"
                ) from None
            except BaseException:
                stop_process(proc)
                raise
        raise PortTaken(f"every port tried was taken: {tried}")
    finally:
        if own_log:
            log.unlink(missing_ok=True)
