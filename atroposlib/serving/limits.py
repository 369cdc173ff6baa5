"""Bound on request bodies of ``atropos-serve-model`` (``--max-request-mb``).

Starlette reads a whole body into memory before the route sees it, and parsing JSON takes
several times its size again, so without a bound one local client posting gigabytes takes the
server's memory. A declared ``Content-Length`` over the bound is answered 413 before anything
is read; a body sent without one (chunked) is counted as it arrives and refused with 413 as
soon as it passes the bound.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.exceptions import HTTPException

from atroposlib.serving.errors import error_body
from atroposlib.utils.http_security import send_response


class RequestSizeLimit:
    """Pure-ASGI middleware: 413 (OpenAI error shape) for bodies over ``max_bytes``."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _message(self) -> str:
        return (
            f"request body exceeds this server's limit of {self.max_bytes / 2**20:g} MB "
            "(--max-request-mb)"
        )

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = None
        for key, value in scope.get("headers", ()):
            if key == b"content-length":
                declared = value
                break
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            body = json.dumps(error_body(self._message(), "invalid_request_error", "body", 413))
            await send_response(
                send,
                413,
                body.encode(),
                [(b"content-type", b"application/json"), (b"connection", b"close")],
            )
            return
        seen = 0

        async def counted() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # FastAPI passes an HTTPException from reading the body through to the
                    # app's handler, which answers it in the OpenAI error shape.
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, counted, send)
