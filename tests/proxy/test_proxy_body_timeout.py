"""The managed-server proxy drops stalled request bodies with 408 and keeps serving others.

Before, a client that declared a body and went idle kept its request open for as long as it
liked. The proxy takes its body timeout from ``ATROPOS_BODY_TIMEOUT`` (30 s by default).
"""

from __future__ import annotations

import time

import httpx

from atroposlib.testing.pipelining import assert_flood_grows_server_little
from atroposlib.testing.ports import free_port
from atroposlib.testing.proxy import running_proxy
from atroposlib.testing.stalled_uploads import answer_of, stalled_uploads
from tests.fake_servers import fake_servers

USER = [{"role": "user", "content": "hi"}]


def test_stalled_bodies_get_408_while_honest_requests_keep_getting_200(tokenizer, tmp_path):
    with (
        fake_servers(1, "--latency-ms", "1") as (fake,),
        running_proxy(
            tmp_path,
            [{"base_url": fake.base_url, "server_type": "vllm"}],
            tokenizer=tokenizer,
            model_name="fake",
            env={"ATROPOS_BODY_TIMEOUT": "1"},
        ) as proxy,
    ):
        with httpx.Client(base_url=proxy.url, timeout=30) as client:
            sid = client.post("/sessions/create", json={}).json()["uuid"]
            path = f"/{sid}/v1/chat/completions"
            liars = stalled_uploads(proxy.port, path, huge=60 * 2**20, partial=b" " * 100_000)
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


def test_the_proxy_stops_reading_a_connection_whose_answers_are_not_taken(tokenizer, tmp_path):
    """A client pipelining ``GET /health`` without reading cannot grow the proxy."""
    # The upstream is never started: /health is all this test asks of the proxy.
    upstream = f"http://127.0.0.1:{free_port()}/v1"
    with running_proxy(
        tmp_path,
        [{"base_url": upstream, "server_type": "vllm"}],
        tokenizer=tokenizer,
        model_name="fake",
    ) as proxy:
        assert_flood_grows_server_little(proxy.port, proxy.proc.pid, "/health")
