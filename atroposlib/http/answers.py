"""Writing whole HTTP answers from pure-ASGI code, in the shape each server speaks.

Middleware that refuses a request (the browser guard, bearer auth, the body bounds) answers
before any framework sees it, so it writes the answer itself with :func:`send_response`. The
body of a refusal comes from an :data:`ErrorShape`: :func:`detail_error` gives FastAPI's
``{"detail": ...}`` (run-api, view-run), :func:`openai_error_bytes` the OpenAI envelope
(serve-model, the proxy), so a client sees one format per server whichever layer refused.

Example::

    await send_error(send, 413, "request body too large", shape=openai_error_bytes, param="body")
"""

from __future__ import annotations

import json
from typing import Callable, Iterable

from atroposlib.http.asgi import Send

__all__ = [
    "JSON",
    "ErrorShape",
    "detail_error",
    "error_body",
    "openai_error_bytes",
    "openai_error_type",
    "send_response",
    "send_error",
]

JSON = (b"content-type", b"application/json")
"""The content-type header of a JSON answer."""

ErrorShape = Callable[[int, str, "str | None"], bytes]
"""``(status, message, param) -> body bytes`` of an error answer."""

_OPENAI_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    503: "server_error",
}


def openai_error_type(status: int) -> str:
    """The OpenAI error ``type`` of a refusal with ``status`` (``invalid_request_error`` by default)."""
    return _OPENAI_TYPES.get(status, "invalid_request_error")


def error_body(message: str, type_: str, param: str | None, code: str | int | None) -> dict:
    """The OpenAI error envelope ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def detail_error(status: int, message: str, param: str | None = None) -> bytes:
    """FastAPI's error body ``{"detail": message}`` (``param`` is not part of that shape)."""
    return json.dumps({"detail": message}).encode()


def openai_error_bytes(status: int, message: str, param: str | None = None) -> bytes:
    """OpenAI's error envelope with the type that fits ``status`` and ``code`` the status."""
    return json.dumps(error_body(message, openai_error_type(status), param, status)).encode()


async def send_response(
    send: Send,
    status: int,
    body: bytes,
    headers: Iterable[tuple[bytes, bytes]] = (JSON,),
) -> None:
    """Send one whole HTTP answer: ``status``, ``headers`` plus its ``content-length``, ``body``."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_error(
    send: Send,
    status: int,
    message: str,
    *,
    shape: ErrorShape = detail_error,
    param: str | None = None,
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    """Send a JSON error answer whose body ``shape`` writes from ``status``, ``message``, ``param``."""
    await send_response(send, status, shape(status, message, param), [JSON, *headers])
