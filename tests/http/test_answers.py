"""The answer writer and the two error shapes our servers speak."""

from __future__ import annotations

import orjson
import pytest

from atroposlib.http.answers import (
    detail_error,
    openai_error_bytes,
    openai_error_type,
    send_error,
    send_response,
)


@pytest.mark.parametrize(
    "status, kind",
    [
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (503, "server_error"),
        (413, "invalid_request_error"),
        (415, "invalid_request_error"),
    ],
)
def test_openai_error_type_by_status(status, kind):
    assert openai_error_type(status) == kind
    body = orjson.loads(openai_error_bytes(status, "no", "body"))
    assert body == {"error": {"message": "no", "type": kind, "param": "body", "code": status}}


def test_detail_shape_is_fastapis():
    assert orjson.loads(detail_error(403, "refused")) == {"detail": "refused"}


async def test_send_response_writes_one_answer_with_its_length():
    sent = []

    async def send(message):
        sent.append(message)

    await send_response(send, 201, b"hello")
    start, body = sent
    assert start["status"] == 201
    assert (b"content-length", b"5") in start["headers"]
    assert (b"content-type", b"application/json") in start["headers"]
    assert body == {"type": "http.response.body", "body": b"hello"}


async def test_send_error_adds_headers_and_uses_the_shape():
    sent = []

    async def send(message):
        sent.append(message)

    await send_error(
        send, 401, "key", shape=openai_error_bytes, headers=[(b"www-authenticate", b"Bearer")]
    )
    assert (b"www-authenticate", b"Bearer") in sent[0]["headers"]
    assert orjson.loads(sent[1]["body"])["error"]["type"] == "authentication_error"
