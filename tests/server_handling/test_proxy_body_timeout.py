"""The managed-server proxy drops stalled request bodies with 408 and keeps serving others.

Before, a client that declared a body and went idle kept its request open for as long as it
liked. The proxy takes its body timeout from ``ATROPOS_BODY_TIMEOUT`` (30 s by default).
"""

from __future__ import annotations

import json
import time

import httpx

from atroposlib.testing.launch import proxy_cmd
from atroposlib.testing.pipelining import assert_flood_grows_server_little
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import start_process, stop_process, wait_http
from atroposlib.testing.stalled_uploads import answer_of, stalled_uploads
from tests.server_handling.conftest import start_fake

USER = [{"role": "user", "content": "hi"}]


def test_stalled_bodies_get_408_while_honest_requests_keep_getting_200(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path / "tok")
    fake_port, port = free_port(), free_port()
    config = {"servers": [{"base_url": f"http://127.0.0.1:{fake_port}/v1", "server_type": "vllm"}]}
    (tmp_path / "servers.json").write_text(json.dumps(config))
    args = ["--config", str(tmp_path / "servers.json")]
    args += ["--tokenizer", str(tmp_path / "tok"), "--model-name", "fake"]
    fake = start_fake(fake_port, "--latency-ms", "1")
    proc = start_process(
        proxy_cmd(port, *args),
        log_path=tmp_path / "proxy.log",
        env={"ATROPOS_BODY_TIMEOUT": "1", "HF_HUB_OFFLINE": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"http://127.0.0.1:{fake_port}/health", timeout=120, proc=fake)
        wait_http(f"{url}/health", timeout=120, proc=proc)
        with httpx.Client(base_url=url, timeout=30) as client:
            sid = client.post("/sessions/create", json={}).json()["uuid"]
            path = f"/{sid}/v1/chat/completions"
            liars = stalled_uploads(port, path, huge=60 * 2**20, partial=b" " * 100_000)
            statuses = []
            deadline = time.monotonic() + 3  # past the body timeout
            while time.monotonic() < deadline:
                r = client.post(path, json={"messages": USER, "max_tokens": 1})
                statuses.append(r.status_code)
        assert statuses and set(statuses) == {200}, statuses
        for sock in liars:
            answer = answer_of(sock)
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            sock.close()
    finally:
        stop_process(proc)
        stop_process(fake)


def test_the_proxy_stops_reading_a_connection_whose_answers_are_not_taken(tokenizer, tmp_path):
    """A client pipelining ``GET /health`` without reading cannot grow the proxy."""
    tokenizer.save_pretrained(tmp_path / "tok")
    fake_port, port = free_port(), free_port()
    config = {"servers": [{"base_url": f"http://127.0.0.1:{fake_port}/v1", "server_type": "vllm"}]}
    (tmp_path / "servers.json").write_text(json.dumps(config))
    args = ["--config", str(tmp_path / "servers.json")]
    args += ["--tokenizer", str(tmp_path / "tok"), "--model-name", "fake"]
    proc = start_process(
        proxy_cmd(port, *args), log_path=tmp_path / "proxy.log", env={"HF_HUB_OFFLINE": "1"}
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=120, proc=proc)
        assert_flood_grows_server_little(port, proc.pid, "/health")
    finally:
        stop_process(proc)
