"""A client that pipelines requests and never reads the answers cannot grow a server.

Before, run-api (like plain uvicorn) kept reading such a connection: every pipelined
request was parsed and queued (about 2 KB each) while the answers piled up, 400,000
``GET /openapi.json`` took the server from 389 to 1,075 MB. Now a connection stops being
read while dozens of its requests wait or its answers are not taken. Pipelining clients
that do read keep getting every answer, in order.
"""

from __future__ import annotations

import socket

import pytest

from atroposlib.testing.pipelining import assert_flood_grows_server_little
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import start_process, stop_process, wait_http
from tests.api.conftest import start_api
from tests.serving.support import serve_cmd


def _server_grows_little(port: int, pid: int) -> None:
    assert_flood_grows_server_little(port, pid, "/openapi.json")


def test_run_api_stops_reading_a_connection_whose_answers_are_not_taken(tmp_path):
    ctx, url = start_api(tmp_path)
    with ctx as proc:
        _server_grows_little(int(url.rsplit(":", 1)[1]), proc.pid)


def test_pipelined_requests_beyond_the_bound_are_all_answered_in_order(tmp_path):
    ctx, url = start_api(tmp_path)
    port = int(url.rsplit(":", 1)[1])
    count = 500  # far beyond the queued-request bound, in one send
    request = b"GET /status-env?env_id=%d HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with ctx, socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"".join(request % i for i in range(count)))
        data = b""
        while data.count(b"HTTP/1.1 ") < count or not data.endswith(b"}"):
            chunk = sock.recv(65536)
            assert chunk, data[-200:]
            data += chunk
        assert data.count(b"HTTP/1.1 ") == count


@pytest.mark.slow
def test_serve_model_stops_reading_a_connection_whose_answers_are_not_taken(
    tiny_model_dir, tmp_path
):
    port = free_port()
    proc = start_process(serve_cmd(tiny_model_dir, port), log_path=tmp_path / "serve.log")
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=180, proc=proc)
        _server_grows_little(port, proc.pid)
    finally:
        stop_process(proc)
