"""Response gzip middleware, packed (LZ4) queue storage, and a packing server end to end."""

from __future__ import annotations

import asyncio
import gzip
import json
from pathlib import Path
from typing import Any, List

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from atroposlib.api.compression import GzipResponseMiddleware, gzip_compress, pack, unpack
from atroposlib.api.store import IncomingGroup, RolloutStore
from tests.api.conftest import Api, group, start_api
from tests.api.store_helpers import REG, started


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=5000), st.integers(1, 9))
def test_pack_and_gzip_round_trip_any_bytes(data: bytes, level: int):
    assert unpack(pack(data), len(data)) == data
    assert gzip.decompress(gzip_compress(data, level)) == data


def _app(chunks: List[bytes], headers: list | None = None, status: int = 200) -> Any:
    async def app(scope: dict, receive: Any, send: Any) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": headers or [(b"content-type", b"application/json")],
            }
        )
        for i, chunk in enumerate(chunks):
            more = i < len(chunks) - 1
            await send({"type": "http.response.body", "body": chunk, "more_body": more})

    return app


def _call(app: Any, accept: bytes | None = b"gzip, deflate") -> tuple[dict, bytes]:
    """Run ``app`` behind the middleware; return (start message headers as dict, joined body)."""
    sent: list = []
    headers = [(b"accept-encoding", accept)] if accept is not None else []
    scope = {"type": "http", "method": "GET", "path": "/", "headers": headers}

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(GzipResponseMiddleware(app, minimum_size=1000, level=1)(scope, receive, send))
    start = sent[0]
    assert start["type"] == "http.response.start"
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return {k.decode(): v.decode() for k, v in start["headers"]}, body


def test_large_response_is_gzipped_with_its_length_and_vary_header():
    payload = json.dumps({"batch": [list(range(500))]}).encode()
    headers, body = _call(_app([payload]))
    assert headers["content-encoding"] == "gzip" and headers["vary"] == "Accept-Encoding"
    assert int(headers["content-length"]) == len(body)
    assert gzip.decompress(body) == payload


def test_small_response_and_client_without_gzip_get_identity():
    small = b'{"status":"ok"}'
    headers, body = _call(_app([small]))
    assert body == small and "content-encoding" not in headers and "vary" not in headers
    large = b"x" * 5000
    headers, body = _call(_app([large]), accept=None)
    assert body == large and "content-encoding" not in headers
    assert headers["vary"] == "Accept-Encoding"


def test_already_encoded_or_partial_response_passes_through_untouched():
    data = gzip.compress(b"y" * 5000)
    headers, body = _call(_app([data], headers=[(b"content-encoding", b"gzip")]))
    assert body == data and headers["content-encoding"] == "gzip"
    headers, body = _call(_app([b"z" * 5000], status=206))
    assert body == b"z" * 5000 and "content-encoding" not in headers


def test_streamed_response_is_gzipped_chunk_by_chunk_without_content_length():
    chunks = [b"a" * 3000, b"b" * 10, b"c" * 4000]
    headers, body = _call(_app(chunks, headers=[(b"content-length", b"7010")]))
    assert headers["content-encoding"] == "gzip" and "content-length" not in headers
    assert gzip.decompress(body) == b"".join(chunks)


def test_response_above_one_mib_is_compressed_off_the_event_loop_and_still_exact():
    payload = json.dumps(list(range(300_000))).encode()
    assert len(payload) > 1 << 20
    headers, body = _call(_app([payload]))
    assert gzip.decompress(body) == payload and int(headers["content-length"]) == len(body)


def _incoming(size: int, tag: int) -> IncomingGroup:
    body = json.dumps({"tokens": [[tag, tag + 1]] * size, "env_id": None}).encode()
    return IncomingGroup(None, size, body)


def test_packed_store_serves_the_same_json_and_counts_json_bytes_against_the_budget():
    raw = started(RolloutStore(10**9, pack_above_bytes=10**9))
    packed = started(RolloutStore(10**9, pack_above_bytes=0))
    groups = [_incoming(4, t) for t in range(6)]
    for store in (raw, packed):
        store.ingest(groups)
    assert all(g.packed for g in packed.queue) and not any(g.packed for g in raw.queue)
    assert packed.queued_bytes == raw.queued_bytes == sum(len(g.body) for g in groups)
    assert packed.latest == raw.latest == groups[-1].body
    while (batch := raw.next_batch()) is not None:
        assert packed.next_batch() == batch
    assert packed.next_batch() is None and packed.queued_bytes == 0


def test_store_packs_only_beyond_the_threshold():
    store = started(RolloutStore(10**9, pack_above_bytes=3 * len(_incoming(4, 0).body)))
    store.ingest([_incoming(4, t) for t in range(6)])
    assert [g.packed for g in store.queue] == [False, False, False, True, True, True]
    assert REG.batch_size == 8  # two groups of 4 per batch
    assert [json.loads(b)["tokens"][0][0] for b in store.next_batch() or []] == [0, 1]


def test_server_with_packing_serves_posted_groups_exactly_gzip_or_identity(tmp_path: Path):
    ctx, url = start_api(tmp_path, "--pack-above-mb", "0")
    with ctx:
        api = Api(url)
        api.start_trainer(batch_size=8)
        env = api.register_env(group_size=4)
        posted = [group(4, seq_len=300, env_id=env, base=b) for b in range(1, 5)]
        for g in posted:
            assert api.client.post("/scored_data", json=g).json() == {"status": "received"}
        assert api.client.get("/latest_example").json()["tokens"] == posted[-1]["tokens"]
        r = api.client.get("/batch", headers={"Accept-Encoding": "gzip"})
        assert r.headers["content-encoding"] == "gzip"
        assert [g["tokens"] for g in r.json()["batch"]] == [p["tokens"] for p in posted[:2]]
        with httpx.Client(base_url=url, timeout=10.0) as plain:
            r = plain.get("/batch", headers={"Accept-Encoding": "identity"})
        assert "content-encoding" not in r.headers
        batch = r.json()["batch"]
        assert [g["masks"] for g in batch] == [p["masks"] for p in posted[2:]]
        api.client.close()


def test_isal_and_zlib_levels_write_the_same_standard_formats():
    import zlib

    from atroposlib.api import compression

    data = json.dumps({"tokens": [list(range(300))] * 4}).encode()
    for level in (1, 3, 6, 9):  # ISA-L up to its level 3, zlib above
        assert gzip.decompress(compression.gzip_compress(data, level)) == data
    assert compression.crc32(data) == zlib.crc32(data)
    headers, body = _call(_app([data]))
    assert headers["content-encoding"] == "gzip" and gzip.decompress(body) == data


def test_group_list_keeps_extra_keys_like_a_single_post_and_tricky_strings_exactly(fresh: Api):
    fresh.start_trainer(batch_size=8)
    env = fresh.register_env(group_size=4)
    posted = [group(4, env_id=env, base=1, trace_id="a-1"), group(4, env_id=env, base=2)]
    r = fresh.client.post("/scored_data_list", json=posted)
    assert r.json() == {"status": "received", "groups_processed": 2}
    batch = fresh.client.get("/batch").json()["batch"]
    assert batch[0]["trace_id"] == "a-1" and batch[0]["tokens"] == posted[0]["tokens"]
    assert batch[1]["tokens"] == posted[1]["tokens"] and batch[1]["advantages"] is None
    # A quoted '}, {' inside an element: each element is still kept exactly as posted.
    tricky = [[{"role": "user", "content": 'x"}, {"y'}]] * 4
    posted = [group(4, env_id=env, base=3, messages=tricky), group(4, env_id=env, base=4)]
    assert fresh.client.post("/scored_data_list", json=posted).status_code == 200
    batch = fresh.client.get("/batch").json()["batch"]
    assert batch[0]["messages"] == tricky and batch[1]["tokens"] == posted[1]["tokens"]
