"""Attacks on a real ``run-api`` process (in memory and ``--persist``): hostile bodies on every
POST endpoint are 4xx, never 5xx; a browser on another site cannot post even without an
``Origin``; a slow upload does not hold back other clients."""

from __future__ import annotations

import gzip
import socket
import threading
import time
from typing import Iterator

import httpx
import pytest

from tests.api.conftest import TRAINER, Api, group, start_api

POSTS = ["/scored_data", "/scored_data_list", "/register", "/register-env", "/disconnect-env"]
JSON = {"Content-Type": "application/json"}
GOOD = b'{"tokens":[[1,2]],"masks":[[1,2]],"scores":[1.0]}'
HOSTILE = {
    "deep array": b"[" * 5000 + b"]" * 5000,
    "deep object": b'{"a":' * 5000 + b"1" + b"}" * 5000,
    "lone surrogate": b'{"tokens":[[1,2]],"masks":[[1,2]],"scores":[1.0],"messages":"\\ud800"}',
    "invalid utf-8": b'{"desired_name":"\xff\xfe","tokens":[[1]]}',
    "5000-digit number": b'{"tokens":[[' + b"9" * 5000 + b"]]}",
    "not json": b"{{{",
    "empty": b"",
    "null": b"null",
    "array of nulls": b"[null,null]",
    "string": b'"x"',
    "duplicate keys": b'{"scores":"x","scores":[1.0],"tokens":[[1,2]],"masks":[[1,2]]}',
}


@pytest.fixture(scope="module")
def persisted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    tmp = tmp_path_factory.mktemp("persist")
    ctx, url = start_api(tmp, "--persist", str(tmp / "queue.db"))
    with ctx as proc:
        a = Api(url, proc=proc)
        yield a
        a.client.close()


def _hostile_statuses(api: Api) -> list[tuple]:
    api.reset()
    api.client.post("/register", json=TRAINER)
    out = []
    for path in POSTS:
        for name, body in HOSTILE.items():
            for encoding in (None, "gzip"):
                headers = dict(JSON)
                if encoding:
                    headers["Content-Encoding"] = encoding
                    body = gzip.compress(body)
                r = api.client.post(path, content=body, headers=headers)
                out.append((path, name, encoding, r.status_code))
    return out


@pytest.mark.parametrize("which", ["memory", "persist"])
def test_hostile_bodies_are_4xx_on_every_post_endpoint(request, which):
    api = request.getfixturevalue("api" if which == "memory" else "persisted")
    bad = [entry for entry in _hostile_statuses(api) if not 200 <= entry[3] < 500]
    assert not bad, bad
    assert api.client.get("/health").status_code == 200


def test_deeply_nested_group_list_is_4xx(fresh: Api):
    r = fresh.client.post("/scored_data_list", content=HOSTILE["deep array"], headers=JSON)
    assert 400 <= r.status_code < 500, r.text


def test_cross_site_posts_without_origin_are_refused(fresh: Api):
    """A browser names the page's origin on every POST; one that says it comes from another
    site and withholds the origin cannot be checked against --cors-origin, so it is refused."""
    fresh.start_trainer()
    cross = {"Sec-Fetch-Site": "cross-site"}
    for path, body in [
        ("/scored_data", group()),
        ("/register", TRAINER),
        ("/scored_data_list", [group()]),
    ]:
        r = fresh.client.post(path, json=body, headers=cross)
        assert r.status_code == 403, (path, r.text)
    wipe = fresh.client.post("/reset_data", headers=cross)
    assert wipe.status_code == 403
    assert fresh.client.post("/scored_data", json=group()).status_code == 200
    same = fresh.client.post(
        "/scored_data", json=group(), headers={"Sec-Fetch-Site": "same-origin"}
    )
    assert same.status_code == 200
    assert fresh.client.get("/status").json()["queue_size"] == 2


def _slow_upload(port: int, seconds: float, result: dict) -> None:
    """POST a body a few bytes at a time for ``seconds`` (bounded), then finish it."""
    body = GOOD
    head = (
        f"POST /scored_data HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head)
        step = max(1, len(body) // 10)
        for i in range(0, len(body), step):
            s.sendall(body[i : i + step])
            time.sleep(seconds / 10)
        result["answer"] = s.recv(4096).split(b"\r\n", 1)[0]


def test_a_slow_upload_does_not_hold_back_other_clients(fresh: Api):
    fresh.start_trainer()
    port = int(fresh.base_url.rsplit(":", 1)[1])
    result: dict = {}
    slow = threading.Thread(target=_slow_upload, args=(port, 2.0, result))
    slow.start()
    try:
        time.sleep(0.2)
        started = time.monotonic()
        for _ in range(20):
            assert fresh.client.post("/scored_data", json=group()).status_code == 200
        assert fresh.client.get("/status").status_code == 200
        assert time.monotonic() - started < 1.5
    finally:
        slow.join(10)
    assert b"200" in result.get("answer", b""), result


@pytest.mark.parametrize(
    "host", ["evil.example", "evil.example:8000", "127.0.0.1.nip.io", "localhost.evil.example"]
)
def test_foreign_host_header_is_refused_on_every_endpoint(fresh: Api, host: str):
    with httpx.Client(base_url=fresh.base_url, timeout=10, headers={"Host": host}) as c:
        assert c.get("/status").status_code == 403
        assert c.post("/scored_data", json=group()).status_code == 403
        assert c.post("/reset_data").status_code == 403


@pytest.mark.parametrize(
    "field, row, where",
    [
        ("tokens", "[1, -5]", ["body", "tokens", 0, 1]),
        ("tokens", "[1, 9223372036854775808]", ["body", "tokens", 0, 1]),
        ("tokens", "[1, 123456789012345678901234567890]", ["body", "tokens", 0, 1]),
        ("masks", "[-100, 123456789012345678901234567890]", ["body", "masks", 0, 1]),
    ],
)
def test_token_ids_a_trainer_cannot_hold_are_422_naming_them(fresh: Api, field, row, where):
    """Ids must fit the trainer's int64 tensors and token ids are never negative; the
    original stored such groups and the trainer crashed on the batch."""
    fresh.start_trainer()
    other = "masks" if field == "tokens" else "tokens"
    body = f'{{"{field}": [{row}], "{other}": [[1, 2]], "scores": [1.0]}}'.encode()
    for path, payload in (("/scored_data", body), ("/scored_data_list", b"[" + body + b"]")):
        r = fresh.client.post(path, content=payload, headers=JSON)
        assert r.status_code == 422, (path, r.text)
        locs = [e["loc"] for e in r.json()["detail"]]
        expected = where if path == "/scored_data" else [where[0], 0, *where[1:]]
        assert expected in locs, (path, locs)
    ok = fresh.client.post(
        "/scored_data",
        content=b'{"tokens": [[0, 7]], "masks": [[-100, 7]], "scores": [1.0]}',
        headers=JSON,
    )
    assert ok.status_code == 200, ok.text
