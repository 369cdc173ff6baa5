"""``BodyLimitMiddleware``: the one body layer of every server (size, budget, stall, gzip)."""

from __future__ import annotations

import asyncio
import gzip

import httpx
import pytest

from atroposlib.http.answers import openai_error_bytes
from atroposlib.http.body import (
    BodyLimitMiddleware,
    BodyReader,
    BodyTimeout,
    BodyTooLarge,
    read_stream,
)
from atroposlib.testing.asgi import read_body, send_plain


async def _echo(scope, receive, send):
    body = await read_body(receive)
    length = dict(scope["headers"]).get(b"content-length", b"-")
    await send_plain(send, length + b":" + body)


def _client(app):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")


async def test_declared_length_over_the_bound_is_413_naming_the_setting():
    app = BodyLimitMiddleware(_echo, max_bytes=10, hints={"size": "--max-request-mb"})
    async with _client(app) as client:
        r = await client.post("/x", content=b"x" * 11)
        assert (await client.post("/x", content=b"x" * 10)).text == "10:" + "x" * 10
    assert r.status_code == 413 and "--max-request-mb" in r.json()["detail"]
    assert r.headers["connection"] == "close"


async def test_chunked_body_is_counted_as_it_arrives_and_passed_on_with_its_length():
    async def chunks(n):
        for _ in range(n):
            yield b"abcd"

    app = BodyLimitMiddleware(_echo, max_bytes=10)
    async with _client(app) as client:
        small = await client.post("/x", content=chunks(2))
        big = await client.post("/x", content=chunks(3))
    assert small.text == "8:abcdabcd"
    assert big.status_code == 413


async def test_openai_shape_names_the_body_param():
    app = BodyLimitMiddleware(_echo, max_bytes=4, shape=openai_error_bytes)
    async with _client(app) as client:
        error = (await client.post("/x", content=b"too long")).json()["error"]
    assert error["param"] == "body" and error["code"] == 413
    assert error["type"] == "invalid_request_error"


async def test_gzip_is_inflated_only_when_asked_and_bounded_by_inflated_size():
    packed = gzip.compress(b'{"a": 1}')
    headers = {"content-encoding": "gzip"}
    inflating = BodyLimitMiddleware(_echo, max_bytes=100, inflate_gzip=True)
    async with _client(inflating) as client:
        assert (await client.post("/x", content=packed, headers=headers)).text == '8:{"a": 1}'
        bad = await client.post("/x", content=b"not gzip", headers=headers)
        assert bad.status_code == 400 and bad.text == "Invalid gzip payload"
        bomb = gzip.compress(b" " * 1000)
        assert (await client.post("/x", content=bomb, headers=headers)).status_code == 413
    passing = BodyLimitMiddleware(_echo, max_bytes=100)
    async with _client(passing) as client:
        r = await client.post("/x", content=packed, headers=headers)
    assert r.content.endswith(packed)


async def test_invalid_content_length_is_400():
    app = BodyLimitMiddleware(_echo, max_bytes=100)
    scope = {"type": "http", "method": "POST", "path": "/", "headers": [(b"content-length", b"x")]}
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    assert sent[0]["status"] == 400
    assert b"Content-Length" in sent[1]["body"]


async def test_budget_refuses_a_second_body_while_the_first_is_held():
    release = asyncio.Event()

    async def slow(scope, receive, send):
        await receive()
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})

    app = BodyLimitMiddleware(slow, max_bytes=100, max_inflight_bytes=60)
    async with _client(app) as client:
        first = asyncio.create_task(client.post("/x", content=b"x" * 50))
        while app.inflight_bytes == 0:
            await asyncio.sleep(0.01)
        second = await client.post("/x", content=b"y" * 50)
        release.set()
        assert (await first).text == "done"
    assert second.status_code == 503 and second.headers["retry-after"] == "1"
    assert "--max-inflight-mb" in second.json()["detail"]
    assert app.inflight_bytes == 0


async def test_a_stalled_body_times_out_and_frees_its_share():
    reader = BodyReader(max_bytes=100, max_inflight_bytes=100, timeout=0.2)
    sent_once = False

    async def receive():
        nonlocal sent_once
        if not sent_once:
            sent_once = True
            return {"type": "http.request", "body": b"abc", "more_body": True}
        await asyncio.Event().wait()  # the client never sends the rest

    with pytest.raises(BodyTimeout) as info:
        await reader.read(receive)
    assert info.value.held == 3
    reader.release(info.value.held)
    assert reader.inflight_bytes == 0 and reader.timed_out == 1


async def test_read_stream_bounds_a_framework_stream():
    async def chunks():
        for _ in range(3):
            yield b"12345"

    assert await read_stream(chunks(), 15) == b"123451234512345"
    with pytest.raises(BodyTooLarge):
        await read_stream(chunks(), 14)
