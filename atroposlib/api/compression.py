"""Compression of the rollout API: gzip responses and compact queued groups.

Deflate is done by ISA-L (the ``isal`` package) up to level 3 and by the
standard ``zlib`` above; both write standard streams. ISA-L's level 1 is about
3.5x faster than zlib's level 1 and compresses a little better, which is what
makes gzip ``/batch`` responses cheap. Levels above ISA-L's 3 use zlib.

- :class:`GzipResponseMiddleware` compresses whole responses in one call (no
  file objects, no copies); it follows Starlette's ``GZipMiddleware`` rules
  (``Accept-Encoding`` must contain ``gzip``, bodies of ``minimum_size`` bytes
  or more, ``Vary: Accept-Encoding``, never re-encodes an encoded response).
- :func:`pack` / :func:`unpack` turn a queued group's JSON into an LZ4 block
  and back; the store uses them for groups queued above a memory threshold.
  LZ4's fast mode halves this JSON at about 2 GB/s and restores it at about
  5 GB/s (ISA-L's fastest deflate: 3.3x smaller, but 0.7 and 1 GB/s), so a
  backlog costs little CPU on the way in and on the way out to ``/batch``.
- :func:`crc32` is the checksum ``--persist`` stores with each group.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from types import ModuleType
from typing import Any

import lz4.block
from isal import isal_zlib

from atroposlib.http.asgi import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

__all__ = ["BACKEND", "GzipResponseMiddleware", "crc32", "gzip_compress", "pack", "unpack"]

_ZLIB: ModuleType = zlib
_ISAL: ModuleType = isal_zlib  # same formats as zlib, several times faster

BACKEND = "isal"
"""Which deflate implementation is in use."""

_ISAL_MAX_LEVEL = 3
_PACK_ACCELERATION = 8
"""LZ4 fast-mode acceleration of :func:`pack`: 2x smaller token JSON at ~13 µs per 26 KiB
(1: 2.6x at 34 µs; 16: 1.8x at 8 µs)."""
_GZIP_WBITS = 16 + zlib.MAX_WBITS
# Above this size a response is compressed in a worker thread so the event loop stays responsive.
_THREAD_MIN_BYTES = 1 << 20
_EXCLUDED_TYPES = ("text/event-stream", "image/", "video/", "audio/", "font/woff")


def _module(level: int) -> Any:
    return _ISAL if level <= _ISAL_MAX_LEVEL else _ZLIB


def gzip_compress(data: bytes, level: int = 1) -> bytes:
    """``data`` as one gzip member (RFC 1952), readable by any gzip decoder."""
    mod = _module(level)
    c = mod.compressobj(level, mod.DEFLATED, _GZIP_WBITS)
    return c.compress(data) + c.flush()


def pack(data: bytes) -> bytes:
    """``data`` as an LZ4 block (fast mode, no size header) for compact storage."""
    return lz4.block.compress(data, mode="fast", acceleration=_PACK_ACCELERATION, store_size=False)


def unpack(data: bytes, size: int) -> bytes:
    """The ``size`` bytes that :func:`pack` compressed into ``data``."""
    return lz4.block.decompress(data, uncompressed_size=size)


def crc32(data: bytes) -> int:
    """``zlib.crc32(data)``, by ISA-L when installed (about 10x faster: it uses carry-less multiply)."""
    return _ISAL.crc32(data)


def _header(headers: list, name: bytes) -> bytes | None:
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


class GzipResponseMiddleware:
    """Gzip responses of ``minimum_size`` bytes or more for clients that accept gzip.

    A response sent in one body message is compressed in one call (in a worker
    thread above 1 MiB); streamed responses are compressed chunk by chunk.
    """

    def __init__(self, app: ASGIApp, minimum_size: int = 1000, level: int = 1) -> None:
        self.app = app
        self.minimum_size = minimum_size
        self.level = level

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        accept = _header(scope["headers"], b"accept-encoding") or b""
        await self.app(scope, receive, _Responder(send, self, b"gzip" in accept.lower()).send)


class _Responder:
    """Per-request state: holds the response start until the first body chunk decides."""

    def __init__(self, send: Send, owner: GzipResponseMiddleware, accepts: bool) -> None:
        self._send = send
        self._owner = owner
        self._accepts = accepts
        self._start: Message | None = None
        self._passthrough = False
        self._stream: Any = None

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            headers = list(message.get("headers", ()))
            content_type = (_header(headers, b"content-type") or b"").decode("latin-1").lower()
            self._passthrough = (
                _header(headers, b"content-encoding") is not None
                or message["status"] == 206
                or any(content_type.startswith(t) for t in _EXCLUDED_TYPES)
            )
            if self._passthrough:
                await self._send(message)
            else:
                self._start = {**message, "headers": headers}
            return
        if kind != "http.response.body" or self._passthrough:
            if self._start is not None and kind != "http.response.body":
                await self._flush_start()
            await self._send(message)
            return
        if self._stream is not None:  # later chunk of a compressed stream
            await self._send({**message, "body": self._compress_chunk(message)})
            return
        if self._start is None:  # later chunk of an uncompressed stream
            await self._send(message)
            return
        body = message.get("body", b"")
        more = message.get("more_body", False)
        start, self._start = self._start, None
        headers = start["headers"]
        if len(body) < self._owner.minimum_size and not more:
            await self._send(start)
            await self._send(message)
            return
        headers.append((b"vary", b"Accept-Encoding"))
        if not self._accepts:
            await self._send(start)
            await self._send(message)
            return
        headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
        headers.append((b"content-encoding", b"gzip"))
        if more:
            mod = _module(self._owner.level)
            self._stream = mod.compressobj(self._owner.level, mod.DEFLATED, _GZIP_WBITS)
            await self._send({**start, "headers": headers})
            await self._send({**message, "body": self._compress_chunk(message)})
            return
        compressed = await self._compress_whole(body)
        headers.append((b"content-length", str(len(compressed)).encode()))
        await self._send({**start, "headers": headers})
        await self._send({"type": "http.response.body", "body": compressed})

    async def _flush_start(self) -> None:
        start, self._start = self._start, None
        assert start is not None
        await self._send(start)

    def _compress_chunk(self, message: Message) -> bytes:
        out = self._stream.compress(message.get("body", b""))
        if message.get("more_body", False):
            return out + self._stream.flush(zlib.Z_SYNC_FLUSH)
        return out + self._stream.flush()

    async def _compress_whole(self, body: bytes) -> bytes:
        level = self._owner.level
        if len(body) < _THREAD_MIN_BYTES:
            return gzip_compress(body, level)
        return await asyncio.to_thread(gzip_compress, body, level)
