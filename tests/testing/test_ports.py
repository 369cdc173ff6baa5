"""``atroposlib.testing.ports``: a server whose port was taken is started again on another."""

from __future__ import annotations

import socket
import sys

import pytest

from atroposlib.testing.ports import PortTaken, free_port, port_was_taken, start_on_free_port
from atroposlib.testing.processes import stop_process


def _http_server(port: int) -> list[str]:
    """Python's own HTTP server on ``port``: it exits with EADDRINUSE when the port is taken."""
    return [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)]


@pytest.fixture
def taken_port():
    """A port held by a listening socket for the test's duration."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_free_port_can_be_bound():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))


def test_a_taken_port_is_retried_on_another(taken_port, tmp_path):
    picks = iter([taken_port, free_port()])
    proc, port = start_on_free_port(
        _http_server, health_path="/", log_path=tmp_path / "s.log", pick_port=lambda: next(picks)
    )
    try:
        assert port != taken_port and proc.poll() is None
        assert port_was_taken((tmp_path / "s.log").read_text())  # the first try said why it failed
    finally:
        stop_process(proc)


def test_only_taken_ports_raise_port_taken(taken_port):
    with pytest.raises(PortTaken, match=str(taken_port)):
        start_on_free_port(_http_server, health_path="/", attempts=2, pick_port=lambda: taken_port)


def test_a_server_failing_for_another_reason_is_not_retried(tmp_path):
    tries = []

    def pick() -> int:
        tries.append(free_port())
        return tries[-1]

    def crashing(port: int) -> list[str]:
        return [sys.executable, "-c", "raise SystemExit('bad flag')"]

    with pytest.raises(RuntimeError, match="bad flag"):
        start_on_free_port(crashing, log_path=tmp_path / "s.log", pick_port=pick)
    assert len(tries) == 1


@pytest.mark.parametrize(
    "output, taken",
    [
        ("OSError: [Errno 98] Address already in use", True),
        ("ERROR: [Errno 48] error while attempting to bind on address", True),
        ("OSError: [Errno 13] Permission denied", False),
        ("", False),
    ],
)
def test_port_was_taken_reads_the_bind_error(output, taken):
    assert port_was_taken(output) is taken
