"""The original's names in ``atroposlib.api.server``: the ``Status``/``Info`` models match
what the routes answer, and ``GZipRequestMiddleware`` inflates gzip request bodies."""

from __future__ import annotations

import gzip
import json

import httpx
import pytest

from atroposlib.api.server import GZipRequestMiddleware, Info, ScoredData, Status
from atroposlib.testing.asgi import read_body, send_plain
from tests.api.conftest import Api


def test_status_and_info_models_match_the_routes(fresh: Api):
    assert Info().batch_size == -1
    fresh.start_trainer(batch_size=8)
    status = Status.model_validate(fresh.client.get("/status").json())
    assert status.queue_size == 0 and status.current_step >= 0
    info = Info.model_validate(fresh.client.get("/info").json())
    assert info.batch_size == 8


async def test_gzip_request_middleware_inflates_bodies():
    seen: list[bytes] = []

    async def app(scope, receive, send):
        seen.append(await read_body(receive))
        await send_plain(send, b"ok")

    payload = json.dumps({"tokens": [[1] * 500]}).encode()
    transport = httpx.ASGITransport(app=GZipRequestMiddleware(app))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        r = await client.post(
            "/x", content=gzip.compress(payload), headers={"Content-Encoding": "gzip"}
        )
        assert r.status_code == 200 and seen == [payload]
        bad = await client.post("/x", content=b"not gzip", headers={"Content-Encoding": "gzip"})
        assert bad.status_code == 400


def test_validate_messages_names_the_message():
    with pytest.raises(ValueError, match=r"messages\[0\]\[1\] lacks content"):
        ScoredData(
            tokens=[[1]],
            masks=[[1]],
            scores=[1.0],
            messages=[[{"role": "user", "content": "a"}, {"role": "assistant"}]],
        )
