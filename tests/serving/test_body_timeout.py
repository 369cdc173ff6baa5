"""``atropos-serve-model`` drops stalled request bodies with 408 and keeps serving honest clients.

Before, a client that declared a large body and went idle kept its connection (and what it
had sent) for as long as it liked; nothing timed it out.
"""

from __future__ import annotations

import time

import httpx

from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import start_process, stop_process, wait_http
from atroposlib.testing.stalled_uploads import answer_of, stalled_uploads
from tests.serving.support import serve_cmd


def test_stalled_bodies_get_408_while_honest_requests_keep_getting_200(tiny_model_dir, tmp_path):
    port = free_port()
    proc = start_process(
        serve_cmd(tiny_model_dir, port, "--body-timeout", "1", "--served-model-name", "tiny"),
        log_path=tmp_path / "serve.log",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", timeout=180, proc=proc)
        # Declared lengths under --max-request-mb (64 MiB), so they are not refused up front.
        liars = stalled_uploads(port, "/v1/completions", huge=60 * 2**20, partial=b" " * 100_000)
        statuses = []
        deadline = time.monotonic() + 3  # past the body timeout and its sweep
        with httpx.Client(base_url=url, timeout=30) as client:
            while time.monotonic() < deadline:
                r = client.post(
                    "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1}
                )
                statuses.append(r.status_code)
        assert statuses and set(statuses) == {200}, statuses
        for sock in liars:
            answer = answer_of(sock)
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert b"body-timeout" in answer
            sock.close()
    finally:
        stop_process(proc)
