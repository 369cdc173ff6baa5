"""A minimal HTTP/1.1 keep-alive JSON server on asyncio (for the fake inference server).

Benchmarks of the client side need an inference stand-in that costs far less CPU per
request than the code under test; uvicorn plus an ASGI app costs a few hundred
microseconds per request, this server a few tens. It speaks just what JSON APIs use:
``Content-Length`` bodies (chunked request bodies are refused with 411), keep-alive
with pipelined requests answered in order, ``Connection: close``, and a client that
disconnects cancels its in-flight request.

    async def handler(method: str, path: str, body: bytes) -> tuple[int, object]: ...
    asyncio.run(serve_forever(handler, "127.0.0.1", 9004))
"""

from __future__ import annotations

import asyncio
import collections
import logging
import signal
from http import HTTPStatus
from typing import Any, Awaitable, Callable

import orjson

from atroposlib.http.answers import error_body

logger = logging.getLogger(__name__)

Handler = Callable[[str, str, bytes], Awaitable[tuple[int, Any]]]
"""``(method, path, body) -> (status, json_body)``; ``path`` has no query string."""

MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 256 * 1024 * 1024


def _dumps(content: Any) -> bytes:
    return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS)


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def render_response(status: int, content: Any, close: bool = False) -> bytes:
    """A complete HTTP/1.1 response with a JSON body."""
    payload = _dumps(content)
    head = (
        f"HTTP/1.1 {status} {_reason(status)}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        f"{'Connection: close' + chr(13) + chr(10) if close else ''}\r\n"
    )
    return head.encode("latin-1") + payload


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, runs them one at a time, answers in order."""

    def __init__(self, handler: Handler):
        self.handler = handler
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.pending: collections.deque[tuple[str, str, bytes, bool]] = collections.deque()
        self.task: asyncio.Task[None] | None = None
        self.closing = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.pending.clear()
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while not self.closing:
            request = self._parse_one()
            if request is None:
                break
            self.pending.append(request)
        if len(self.buffer) > MAX_HEADER_BYTES and b"\r\n\r\n" not in self.buffer:
            self._fail(431, "request headers too large")
            return
        self._next()

    def _parse_one(self) -> tuple[str, str, bytes, bool] | None:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return None
        head = bytes(self.buffer[:end]).decode("latin-1")
        lines = head.split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            self._fail(400, "malformed request line")
            return None
        method, target, version = parts
        length = 0
        close = version == "HTTP/1.0"
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-length":
                try:
                    length = int(value.strip())
                except ValueError:
                    self._fail(400, "bad Content-Length")
                    return None
            elif name == "transfer-encoding" and value.strip().lower() != "identity":
                self._fail(411, "chunked request bodies are not supported; send Content-Length")
                return None
            elif name == "connection":
                token = value.strip().lower()
                close = token == "close" or (close and token != "keep-alive")
        if length < 0 or length > MAX_BODY_BYTES:
            self._fail(413, "request body too large")
            return None
        start = end + 4
        if len(self.buffer) < start + length:
            return None
        body = bytes(self.buffer[start : start + length])
        del self.buffer[: start + length]
        return method, target.split("?", 1)[0], body, close

    def _fail(self, status: int, message: str) -> None:
        self.closing = True
        self.pending.clear()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(
                render_response(
                    status, error_body(message, "invalid_request_error", None, status), close=True
                )
            )
            self.transport.close()

    def _next(self) -> None:
        if self.task is None and self.pending and not self.closing:
            self.task = asyncio.get_running_loop().create_task(self._run(*self.pending.popleft()))

    async def _run(self, method: str, path: str, body: bytes, close: bool) -> None:
        try:
            status, content = await self.handler(method, path, body)
        except asyncio.CancelledError:
            return
        except Exception as e:  # a handler bug answers 500 and is logged, the server stays up
            logger.exception("handler failed for %s %s", method, path)
            message = f"internal error: {type(e).__name__}"
            status, content = 500, error_body(message, "internal_error", None, 500)
        self.task = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        transport.write(render_response(status, content, close=close))
        if close:
            self.closing = True
            transport.close()
            return
        self._next()


async def serve_forever(handler: Handler, host: str, port: int) -> None:
    """Serve ``handler`` on ``host:port`` until SIGINT/SIGTERM."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread / platform
            pass
    server = await loop.create_server(
        lambda: _Connection(handler), host, port, reuse_address=True, backlog=2048
    )
    logger.info("lean HTTP server on http://%s:%d", host, port)
    try:
        await stop.wait()
    finally:
        server.close()
