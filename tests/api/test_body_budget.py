"""The in-flight budget counts bytes received, and stalled bodies are dropped (408).

Before, ``--max-inflight-mb`` was charged with each body's declared
``Content-Length`` before a byte arrived, and nothing timed out a stalled body:
two sockets declaring 256 MiB and sending one byte made every other post a 503
for as long as they stayed open.
"""

from __future__ import annotations

import json
import socket
import time

from atroposlib.testing.stalled_uploads import answer_of, stalled_uploads
from tests.api.conftest import Api, group, start_api


def test_stalled_and_lying_uploads_cannot_starve_honest_posters(tmp_path):
    ctx, url = start_api(tmp_path, "--max-inflight-mb", "1", "--body-timeout", "1")
    port = int(url.rsplit(":", 1)[1])
    with ctx:
        api = Api(url)
        api.start_trainer(batch_size=4)
        # Two 256 MiB liars with one byte each, an idle head, and 600 KiB of a real body.
        liars = stalled_uploads(port, "/scored_data", partial=b" " * 600_000)
        statuses = []
        deadline = time.monotonic() + 3  # past the body timeout and its sweep
        base = 1
        while time.monotonic() < deadline:
            r = api.client.post("/scored_data", json=group(4, seq_len=500, base=base))
            statuses.append(r.status_code)
            base += 1
        assert set(statuses) == {200}, statuses
        for sock in liars:
            answer = answer_of(sock)
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert b"body-timeout" in answer
            sock.close()
        assert api.client.post("/scored_data", json=group(4, base=base)).status_code == 200
        api.client.close()


def test_in_flight_bodies_are_bounded_by_bytes_received_with_503_and_retry_after(tmp_path):
    ctx, url = start_api(tmp_path, "--max-inflight-mb", "1", "--max-request-mb", "4")
    port = int(url.rsplit(":", 1)[1])
    with ctx:
        api = Api(url)
        api.start_trainer(batch_size=4)
        body = json.dumps(group(4, seq_len=40_000)).encode()  # ~2.5 MiB, sent in two halves
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(
            b"POST /scored_data HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body[: 3 * len(body) // 5]
        )
        # 1.5 MiB really received: more than the budget, so other bodies wait their turn.
        for _ in range(100):
            r = api.client.post("/scored_data", json=group(4, seq_len=10_000, base=2))
            if r.status_code == 503:
                break
            time.sleep(0.05)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert "max-inflight-mb" in r.json()["detail"]
        assert api.client.get("/status").status_code == 200  # requests without a body pass
        slow.sendall(body[3 * len(body) // 5 :])
        assert answer_of(slow).startswith(b"HTTP/1.1 200")
        slow.close()
        assert api.client.post("/scored_data", json=group(4, base=3)).status_code == 200
        api.client.close()
