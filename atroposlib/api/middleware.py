"""Pure-ASGI middleware of the rollout API: body size limit, in-flight bound, body timeout, gzip.

Bearer auth and the browser guard live in :mod:`atroposlib.utils.http_security` (one
implementation for every server); ``BearerAuthMiddleware`` is re-exported here for old imports.
"""

from __future__ import annotations

import json
import logging
import zlib
from typing import Any, Awaitable, Callable, Iterable, MutableMapping

from atroposlib.utils.http_body import (
    BODY_TIMEOUT,
    BodyBusy,
    BodyError,
    BodyReader,
    BodyTooLarge,
    replayed,
)
from atroposlib.utils.http_security import BearerAuthMiddleware, send_response

logger = logging.getLogger(__name__)

__all__ = ["BearerAuthMiddleware", "GZipRequestMiddleware", "RequestBodyMiddleware"]

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


class RequestBodyMiddleware:
    """Read request bodies under the size bound, the in-flight budget and the body timeout.

    Bodies above ``max_bytes`` get 413 (declared ones before anything is read);
    ``Content-Encoding: gzip`` bodies are inflated (bad gzip → 400). With
    ``max_inflight_bytes``, the bodies of all requests being received or
    processed at once are bounded, counting the bytes actually received: a
    request whose next bytes would take the total beyond it gets 503 with
    ``Retry-After`` (unless it is the only one holding any, so a single body
    up to ``max_bytes`` is always served). A declared ``Content-Length`` costs
    nothing until its bytes arrive, and a body that receives nothing for
    ``body_timeout`` seconds is dropped with 408, freeing its share. A gzipped
    body counts with its inflated size once inflated.
    """

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        max_inflight_bytes: int | None = None,
        body_timeout: float | None = BODY_TIMEOUT,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.reader = BodyReader(max_bytes, max_inflight_bytes, body_timeout)

    @property
    def inflight_bytes(self) -> int:
        """Bytes of request bodies received and not yet released."""
        return self.reader.inflight_bytes

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

    async def _timed_out(self, send: Send) -> None:
        logger.info("dropped a request body that received nothing for %ss", self.reader.timeout)
        await _send_error(
            send,
            408,
            {
                "detail": f"request body incomplete: nothing received for {self.reader.timeout:g} "
                "seconds (run-api --body-timeout)"
            },
            headers=[_CLOSE],
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length: int | None = None
        gzipped = chunked = False
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    await _send_error(send, 400, {"detail": "invalid Content-Length header"})
                    return
            elif name == b"content-encoding" and b"gzip" in value.lower():
                gzipped = True
            elif name == b"transfer-encoding":
                chunked = True
        if length is not None and length > self.max_bytes:
            await self._too_large(send, length)
            return
        if not length and not chunked:
            # No body (HTTP/1.1 has one only with a length or chunked encoding): nothing to read.
            await self.app(scope, receive, send)
            return
        held = 0
        try:
            body, held = await self.reader.read(receive)
            if body is None:
                return
            if gzipped or length is None:
                held = await self._inflated(scope, receive, send, body, gzipped, held)
                return
            await self.app(scope, replayed(body, receive), send)
        except BodyError as e:
            held = e.held
            if isinstance(e, BodyTooLarge):
                await self._too_large(send, self.max_bytes + 1)
            elif isinstance(e, BodyBusy):
                await self._busy(send)
            else:
                await self._timed_out(send)
        finally:
            self.reader.release(held)

    async def _too_large(self, send: Send, size: int) -> None:
        await _send_error(
            send,
            413,
            {
                "detail": f"request body of {size} bytes exceeds the limit of "
                f"{self.max_bytes} bytes (run-api --max-request-mb)"
            },
        )

    async def _inflated(
        self, scope: Scope, receive: Receive, send: Send, body: bytes, inflate: bool, held: int
    ) -> int:
        """Inflate a gzipped body and pass it on with its real length; returns the share held."""
        headers = [
            (k, v)
            for k, v in scope["headers"]
            if k not in (b"content-encoding", b"content-length", b"transfer-encoding")
        ]
        if inflate:
            inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
            try:
                raw = body
                body = inflater.decompress(raw, self.max_bytes + 1)
                if len(body) > self.max_bytes or inflater.unconsumed_tail:
                    await self._too_large(send, self.max_bytes + 1)
                    return held
                if not inflater.eof:
                    raise zlib.error("truncated gzip stream")
            except zlib.error as e:
                logger.info("rejected a request with a bad gzip body: %s", e)
                await _send_error(send, 400, "Invalid gzip payload", text=True)
                return held
            del raw
            if len(body) > held:
                if not self.reader.reserve(len(body) - held, held):
                    await self._busy(send)
                    return held
                held = len(body)
        headers.append((b"content-length", str(len(body)).encode()))
        await self.app({**scope, "headers": headers}, replayed(body, receive), send)
        return held


_CLOSE = (b"connection", b"close")
"""A stalled body is never read to its end: its connection cannot carry another request."""


class GZipRequestMiddleware(RequestBodyMiddleware):
    """The original's name: inflates ``Content-Encoding: gzip`` request bodies (bad gzip →
    400). It is :class:`RequestBodyMiddleware` with its bounds: bodies above ``max_bytes``
    (default 256 MiB, run-api's ``--max-request-mb``; inflated size) get 413.

    Example::

        app = GZipRequestMiddleware(app)
    """

    def __init__(self, app: ASGIApp, max_bytes: int = 256 << 20, **kwargs: Any) -> None:
        super().__init__(app, max_bytes, **kwargs)
