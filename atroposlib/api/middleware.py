"""Pure-ASGI middleware of the rollout API: bearer auth, body size limit, gzip request bodies."""

from __future__ import annotations

import hmac
import json
import logging
import zlib
from typing import Any, Awaitable, Callable, Iterable, MutableMapping

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
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BearerAuthMiddleware:
    """Require ``Authorization: Bearer KEY`` on every path except the open ones (401 otherwise)."""

    def __init__(
        self, app: ASGIApp, api_key: str, open_paths: Iterable[str] = ("/", "/health")
    ) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._open = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open:
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        await _send_error(
            send,
            401,
            {"detail": "missing or invalid API key: send 'Authorization: Bearer <key>'"},
            headers=[(b"www-authenticate", b"Bearer")],
        )


class _BodyTooLarge(Exception):
    pass


class RequestBodyMiddleware:
    """Reject bodies above ``max_bytes`` (413) and inflate ``Content-Encoding: gzip`` bodies (bad gzip → 400)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

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
        if length is not None and not gzipped:
            await self.app(scope, receive, send)
            return
        await self._buffered(scope, receive, send, inflate=gzipped)

    async def _too_large(self, send: Send, size: int) -> None:
        await _send_error(
            send,
            413,
            {
                "detail": f"request body of {size} bytes exceeds the limit of "
                f"{self.max_bytes} bytes (run-api --max-request-mb)"
            },
        )

    async def _read_all(self, receive: Receive) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _buffered(self, scope: Scope, receive: Receive, send: Send, inflate: bool) -> None:
        """Read the whole (bounded) body, inflate it if gzipped, and replay it to the app."""
        try:
            body = await self._read_all(receive)
        except _BodyTooLarge:
            await self._too_large(send, self.max_bytes + 1)
            return
        if body is None:
            return
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
                    return
                if not inflater.eof:
                    raise zlib.error("truncated gzip stream")
            except zlib.error as e:
                logger.info("rejected a request with a bad gzip body: %s", e)
                await _send_error(send, 400, "Invalid gzip payload", text=True)
                return
        headers.append((b"content-length", str(len(body)).encode()))
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app({**scope, "headers": headers}, replay, send)
