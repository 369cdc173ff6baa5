"""Pure-ASGI middleware of the rollout API: body size limit, in-flight bound, gzip request bodies.

Bearer auth and the browser guard live in :mod:`atroposlib.utils.http_security` (one
implementation for every server); ``BearerAuthMiddleware`` is re-exported here for old imports.
"""

from __future__ import annotations

import json
import logging
import zlib
from typing import Any, Awaitable, Callable, Iterable, MutableMapping

from atroposlib.utils.http_security import BearerAuthMiddleware, send_response

logger = logging.getLogger(__name__)

__all__ = ["BearerAuthMiddleware", "RequestBodyMiddleware"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def _send_error(
    send: Send,
    status: int,
    payload: Any,
    headers: Iterable[tuple[bytes, bytes]] = (),
    text: bool = False,
) -> None:
    body = payload.encode() if text else json.dumps(payload).encode()
    content_type = b"text/plain; charset=utf-8" if text else b"application/json"
    await send_response(send, status, body, [(b"content-type", content_type), *headers])


class _BodyTooLarge(Exception):
    def __init__(self, reserved: int) -> None:
        super().__init__()
        self.reserved = reserved


class _Busy(Exception):
    def __init__(self, reserved: int) -> None:
        super().__init__()
        self.reserved = reserved


class RequestBodyMiddleware:
    """Reject bodies above ``max_bytes`` (413) and inflate ``Content-Encoding: gzip`` bodies (bad gzip → 400).

    With ``max_inflight_bytes``, the bodies of all requests being received or
    processed at once are bounded: a request whose body would take the total
    beyond it gets 503 with ``Retry-After`` (unless nothing else is in flight,
    so a single body up to ``max_bytes`` is always served). A gzipped body
    counts with its inflated size once inflated.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, max_inflight_bytes: int | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.inflight_bytes = 0

    def _reserve(self, size: int) -> bool:
        limit = self.max_inflight_bytes
        if size <= 0:
            return True  # a request without a body is never refused for the bodies of others
        if limit is not None and self.inflight_bytes and self.inflight_bytes + size > limit:
            return False
        self.inflight_bytes += size
        return True

    async def _busy(self, send: Send) -> None:
        logger.info("refused a request body: %d bytes already in flight", self.inflight_bytes)
        await _send_error(
            send,
            503,
            {
                "detail": f"server busy: {self.inflight_bytes} bytes of request bodies in flight "
                f"(run-api --max-inflight-mb {self.max_inflight_bytes // (1024 * 1024)}); retry later"
            },
            headers=[(b"retry-after", b"1")],
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length: int | None = None
        gzipped = False
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    await _send_error(send, 400, {"detail": "invalid Content-Length header"})
                    return
            elif name == b"content-encoding" and b"gzip" in value.lower():
                gzipped = True
        if length is not None and length > self.max_bytes:
            await self._too_large(send, length)
            return
        if not length and not gzipped and length is not None:
            await self.app(scope, receive, send)
            return
        reserved = length or 0
        if not self._reserve(reserved):
            await self._busy(send)
            return
        try:
            if length is not None and not gzipped:
                await self.app(scope, receive, send)
            else:
                reserved = await self._buffered(scope, receive, send, gzipped, reserved)
        finally:
            self.inflight_bytes -= reserved

    async def _too_large(self, send: Send, size: int) -> None:
        await _send_error(
            send,
            413,
            {
                "detail": f"request body of {size} bytes exceeds the limit of "
                f"{self.max_bytes} bytes (run-api --max-request-mb)"
            },
        )

    async def _read_all(self, receive: Receive, reserved: int) -> tuple[bytes | None, int]:
        """The whole body (None when the client left) and the bytes now reserved for it."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, reserved
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _BodyTooLarge(reserved)
            if size > reserved:
                if not self._reserve(size - reserved):
                    raise _Busy(reserved)
                reserved = size
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), reserved

    async def _buffered(
        self, scope: Scope, receive: Receive, send: Send, inflate: bool, reserved: int
    ) -> int:
        """Read the whole (bounded) body, inflate it if gzipped, and replay it to the app.

        Returns the bytes reserved in the in-flight budget, for the caller to release.
        """
        try:
            body, reserved = await self._read_all(receive, reserved)
        except _BodyTooLarge as e:
            await self._too_large(send, self.max_bytes + 1)
            return e.reserved
        except _Busy as e:
            await self._busy(send)
            return e.reserved
        if body is None:
            return reserved
        headers = [
            (k, v) for k, v in scope["headers"] if k not in (b"content-encoding", b"content-length")
        ]
        if inflate:
            inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
            try:
                raw = body
                body = inflater.decompress(raw, self.max_bytes + 1)
                if len(body) > self.max_bytes or inflater.unconsumed_tail:
                    await self._too_large(send, self.max_bytes + 1)
                    return reserved
                if not inflater.eof:
                    raise zlib.error("truncated gzip stream")
            except zlib.error as e:
                logger.info("rejected a request with a bad gzip body: %s", e)
                await _send_error(send, 400, "Invalid gzip payload", text=True)
                return reserved
            del raw
            if len(body) > reserved:
                if not self._reserve(len(body) - reserved):
                    await self._busy(send)
                    return reserved
                reserved = len(body)
        headers.append((b"content-length", str(len(body)).encode()))
        sent = False

        async def replay() -> Message:
            nonlocal sent, body
            if sent:
                return await receive()
            sent = True
            message = {"type": "http.request", "body": body, "more_body": False}
            body = b""  # the app holds the only reference from here on
            return message

        await self.app({**scope, "headers": headers}, replay, send)
        return reserved
