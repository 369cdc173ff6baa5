"""Bounds on request bodies of ``atropos-serve-model`` (``--max-request-mb``, ``--body-timeout``).

Starlette reads a whole body into memory before the route sees it, and parsing JSON takes
several times its size again, so without a bound one local client posting gigabytes takes the
server's memory. A declared ``Content-Length`` over the bound is answered 413 before anything
is read; a body sent without one (chunked) is counted as it arrives and refused with 413 as
soon as it passes the bound. A declared length reserves nothing: only bytes that arrive are
held, and a body that receives nothing for ``--body-timeout`` seconds is dropped with 408, so
clients that declare a huge body and go idle keep neither memory nor a connection.
"""

from __future__ import annotations

import json
from typing import Any

from atroposlib.serving.errors import error_body
from atroposlib.utils.http_body import (
    BODY_TIMEOUT,
    BodyReader,
    BodyTimeout,
    BodyTooLarge,
    replayed,
)
from atroposlib.utils.http_security import send_response

_JSON = (b"content-type", b"application/json")


class RequestSizeLimit:
    """Pure-ASGI middleware: 413 for bodies over ``max_bytes``, 408 for stalled ones (OpenAI shape)."""

    def __init__(self, app: Any, max_bytes: int, body_timeout: float | None = BODY_TIMEOUT) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.reader = BodyReader(max_bytes, None, body_timeout)

    def _message(self) -> str:
        return (
            f"request body exceeds this server's limit of {self.max_bytes / 2**20:g} MB "
            "(--max-request-mb)"
        )

    async def _refuse(self, send: Any, status: int, message: str, param: str = "body") -> None:
        body = json.dumps(error_body(message, "invalid_request_error", param, status))
        await send_response(send, status, body.encode(), [_JSON, (b"connection", b"close")])

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = chunked = None
        for key, value in scope.get("headers", ()):
            if key == b"content-length":
                declared = value
            elif key == b"transfer-encoding":
                chunked = value
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send, 413, self._message())
            return
        if (declared is None or declared in (b"0", b"")) and chunked is None:
            await self.app(scope, receive, send)  # no body to read
            return
        try:
            body, held = await self.reader.read(receive)
        except BodyTooLarge:
            await self._refuse(send, 413, self._message())
            return
        except BodyTimeout:
            await self._refuse(
                send,
                408,
                f"request body incomplete: nothing received for {self.reader.timeout:g} "
                "seconds (--body-timeout)",
            )
            return
        if body is None:
            return  # the client left
        await self.app(scope, replayed(body, receive), send)
