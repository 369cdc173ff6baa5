"""Fake inference servers as real processes, for the server-layer and proxy tests (the
``fake_pool`` fixture in ``tests/conftest.py`` is five of them shared by a session)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import httpx

from atroposlib.testing.launch import fake_server_cmd
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import start_process, stop_process, wait_http


@dataclass
class FakeServer:
    """A running fake server process."""

    port: int
    proc: object

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def configure(self, **settings: object) -> dict:
        r = httpx.post(f"{self.url}/fake/config", json=settings, timeout=5)
        r.raise_for_status()
        return r.json()

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/fake/stats", timeout=5).json()


def start_fake(port: int, *extra: str, log_path=None):
    """Start a fake server process on ``port`` (not waiting for it)."""
    return start_process(fake_server_cmd(port, *extra), log_path=log_path)


@contextlib.contextmanager
def fake_servers(count: int, *extra: str, tmp_path=None) -> Iterator[list[FakeServer]]:
    """Start ``count`` fake servers in parallel and stop them afterwards."""
    servers: list[FakeServer] = []
    try:
        for i in range(count):
            port = free_port()
            log = (tmp_path / f"fake{i}.log") if tmp_path else None
            servers.append(FakeServer(port, start_fake(port, *extra, log_path=log)))
        for s in servers:
            wait_http(f"{s.url}/health", timeout=60, proc=s.proc)
        yield servers
    finally:
        for s in servers:
            stop_process(s.proc)
