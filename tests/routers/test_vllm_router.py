"""vllm-router in front of two ``atropos-serve-model``: a session stays on one server, and
moves when that server dies (docs/multi-node.md, "Session affinity and routers").

``vllm-router`` (the registry's Rust router, in ``.venv-router``: ``make .venv-router``) with
``--policy consistent_hash`` picks a worker by the request's ``X-Session-ID`` header, the
header every request of one trajectory carries (``ManagedServer``, the proxy). Which server
answered is read from each server's access log (one ``POST /v1/completions`` line a request;
requests are sent one at a time).

sglang-router (0.3.2) was tried the same way and is not used: it fronts our server, but pins
only on its own ``X-SMG-Routing-Key`` header (``--policy manual``) and spreads the turns of
one ``X-Session-ID`` over both servers.

Without the router the test skips with the command that installs it; under CI (``CI`` set) it
fails instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, Iterator, List

import httpx
import pytest

from atroposlib.testing.multinode import serve_model_node_cmd
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import wait_http
from atroposlib.utils.parent_death import die_with_parent

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
ROUTER = Path(os.environ.get("ATROPOS_VLLM_ROUTER", ROOT / ".venv-router" / "bin" / "vllm-router"))
SESSIONS = [f"trajectory-{i}" for i in range(10)]
TURNS = 3


def _start(cmd: List[str], log: Path) -> subprocess.Popen:
    with log.open("ab") as out:
        return subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
            start_new_session=True,
            preexec_fn=die_with_parent,
        )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait(timeout=10)


class Fleet:
    """Two servers, their logs, and the router in front."""

    def __init__(self, tmp: Path, model: Path) -> None:
        self.tmp, self.model = tmp, model
        self.servers: Dict[str, subprocess.Popen] = {}
        self.logs: Dict[str, Path] = {}
        self.urls: Dict[str, str] = {}
        self.router: subprocess.Popen | None = None
        self.router_url = ""

    def start(self) -> None:
        for name in ("a", "b"):
            port = free_port()
            self.logs[name] = self.tmp / f"server-{name}.log"
            cmd = serve_model_node_cmd(
                self.model, "127.0.0.1", port, "--cpu-threads", "1", "--seed", "0"
            )
            self.servers[name] = _start(cmd, self.logs[name])
            self.urls[name] = f"http://127.0.0.1:{port}"
        for name, proc in self.servers.items():
            wait_http(f"{self.urls[name]}/health", timeout=240, proc=proc)
        port = free_port()
        self.router_url = f"http://127.0.0.1:{port}"
        urls = list(self.urls.values())
        self.router = _start(
            [
                str(ROUTER), "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *urls, "--policy", "consistent_hash",
                "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
            ],
            self.tmp / "router.log",
        )  # fmt: skip
        wait_http(f"{self.router_url}/health", timeout=120, proc=self.router)

    def stop(self) -> None:
        for proc in [self.router, *self.servers.values()]:
            if proc is not None:
                _stop(proc)

    def counts(self) -> Dict[str, int]:
        """Completions each server has answered so far."""
        return {
            name: log.read_text(errors="replace").count("POST /v1/completions")
            for name, log in self.logs.items()
        }

    def first_turn_after_detection(self, session: str, within_s: float) -> str:
        """``turn`` retried while the router still sends ``session`` to a dead server."""
        deadline = time.monotonic() + within_s
        while True:
            try:
                return self.turn(session)
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def turn(self, session: str) -> str:
        """One request of ``session`` through the router; the server that answered it."""
        before = self.counts()
        r = httpx.post(
            f"{self.router_url}/v1/completions",
            json={"model": str(self.model), "prompt": "1 + 1 =", "max_tokens": 2},
            headers={"X-Session-ID": session},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] is not None
        grew = [n for n, c in self.counts().items() if c > before[n]]
        assert len(grew) == 1, (before, self.counts())
        return grew[0]


@pytest.fixture
def fleet(tmp_path, tiny_model_dir) -> Iterator[Fleet]:
    if not ROUTER.exists():
        reason = f"vllm-router not found at {ROUTER}: `make .venv-router` installs it"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    fleet = Fleet(tmp_path, tiny_model_dir)
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.stop()


def test_router_pins_a_session_and_fails_over(fleet):
    # Pinning: every turn of a session reaches the server its first turn reached, and the
    # sessions are spread over both servers.
    pinned = {}
    for session in SESSIONS:
        served = {fleet.turn(session) for _ in range(TURNS)}
        assert len(served) == 1, (session, served)
        pinned[session] = served.pop()
    assert set(pinned.values()) == {"a", "b"}, pinned

    # Failover: the server of the first session dies; its turns still succeed, now on the
    # other server, and stay there.
    session = SESSIONS[0]
    dead = pinned[session]
    _stop(fleet.servers[dead])
    alive = "b" if dead == "a" else "a"
    # The router learns of the death from its health check (every second, one failure): a
    # request inside that window may get its 500; within a few checks the session moves.
    assert fleet.first_turn_after_detection(session, within_s=30) == alive
    assert [fleet.turn(session) for _ in range(TURNS)] == [alive] * TURNS
    # The sessions pinned to the living server did not move.
    for other, server in pinned.items():
        if server == alive:
            assert fleet.turn(other) == alive
