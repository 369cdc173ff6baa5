"""``atropos-sandbox-server`` as a real process: the original's ``/execute`` requests and
answers, under the shared security model (key, browser guard, bounded bodies)."""

from __future__ import annotations

import sys
from typing import Iterator

import httpx
import pytest

from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import running_process

KEY = "sandbox-test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("sandbox_server") / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "atroposlib.cli.sandbox_server",
        "--port",
        str(port),
        "--timeout-s",
        "1",
        "--max-request-mb",
        "0.25",
    ]
    with running_process(
        cmd,
        health_url=f"http://127.0.0.1:{port}/health",
        timeout=60,
        log_path=log,
        env={"ATROPOS_SANDBOX_API_KEY": KEY},
    ):
        yield f"http://127.0.0.1:{port}"


def _post(server: str, body, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}", **kwargs.pop("headers", {})}
    return httpx.post(f"{server}/execute", json=body, headers=headers, timeout=30, **kwargs)


def test_execute_answers_the_original_request(server):
    r = _post(server, {"code": "x = int(input())\nprint(x * x)", "input": "4"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["output"] == "16\n" and body["error"] == ""
    assert body["returncode"] == 0 and body["reason"] == "ok"


def test_execute_reports_errors_and_bounds_in_error(server):
    crash = _post(server, {"code": "raise SystemExit('bad input')", "input": ""}).json()
    assert crash["reason"] == "error" and "bad input" in crash["error"], crash
    hang = _post(server, {"code": "while True:\n    pass", "input": ""}).json()
    assert hang["reason"] == "timeout" and "deadline" in hang["error"], hang


def test_bad_requests_get_the_original_error_shape(server):
    no_code = _post(server, {"input": "1"})
    assert no_code.status_code == 400 and no_code.json()["error"] == "No code provided"
    bad_input = _post(server, {"code": "print(1)", "input": [1, 2]})
    assert bad_input.status_code == 422 and bad_input.json()["error"].startswith("input:")
    not_object = _post(server, ["print(1)"])
    assert not_object.status_code == 422 and "body" in not_object.json()["error"]
    broken = httpx.post(
        f"{server}/execute",
        content=b"{",
        timeout=10,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert broken.status_code == 400 and "JSON" in broken.json()["error"]
    huge = _post(server, {"code": "#" * (300 << 10), "input": ""})
    assert huge.status_code == 413


def test_the_key_and_the_browser_guard_apply(server):
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200  # open
    anonymous = httpx.post(f"{server}/execute", json={"code": "print(1)"}, timeout=10)
    assert anonymous.status_code == 401
    foreign = _post(server, {"code": "print(1)"}, headers={"Origin": "https://evil.example"})
    assert foreign.status_code == 403
    rebound = _post(server, {"code": "print(1)"}, headers={"Host": "evil.example"})
    assert rebound.status_code == 403
    form = httpx.post(
        f"{server}/execute",
        content=b"code=print(1)",
        timeout=10,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "text/plain"},
    )
    assert form.status_code == 415


def test_the_server_refuses_to_start_without_bubblewrap(monkeypatch, tmp_path):
    from atroposlib.cli.sandbox_server import main

    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    with pytest.raises(SystemExit) as info:
        main(["--port", "0"])
    message = str(info.value)
    assert message.startswith("atropos-sandbox-server:") and "\n" not in message
    assert "apt-get install bubblewrap" in message
