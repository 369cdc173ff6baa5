"""Reading request bodies under a size bound, an in-flight budget and a stall timeout.

:class:`BodyLimitMiddleware` applies it in front of every server we ship (the last layer
:func:`atroposlib.http.server.build_server` adds); :class:`BodyReader` is the reading itself.

A server that reserves memory for a body from its declared ``Content-Length``
can be starved by clients that declare a huge length, send one byte and go
idle; one that waits forever for the rest of a body keeps such clients (and
what they did send) for as long as they like. :class:`BodyReader` reads a body
the way every server we ship should:

* the in-flight budget is charged with the bytes actually received, chunk by
  chunk, and given back when the request ends;
* a body over ``max_bytes`` is refused (:class:`BodyTooLarge`) as soon as it
  passes the bound (declared or not);
* a body that makes no progress for ``timeout`` seconds is dropped
  (:class:`BodyTimeout`, answered 408), which frees its share.

The stall check costs no timer per request: one sweep every ``timeout / 4``
seconds looks at the reads in progress and cancels those that received
nothing during the last ``timeout`` (so a stalled body is dropped between
``timeout`` and 1.25 x ``timeout`` after its last byte).

Example::

    reader = BodyReader(max_bytes=2**20, max_inflight_bytes=64 * 2**20, timeout=30)
    try:
        body, held = await reader.read(receive)
        ...
    except BodyTimeout:
        ...  # answer 408 with Connection: close
    finally:
        reader.release(held)
"""

from __future__ import annotations

import asyncio
import logging
import os
import zlib
from typing import Any, AsyncIterator, MutableMapping

from atroposlib.http.answers import ErrorShape, detail_error, send_error, send_response
from atroposlib.http.asgi import ASGIApp, Receive, Scope, Send

logger = logging.getLogger(__name__)

__all__ = [
    "BODY_TIMEOUT",
    "BodyBusy",
    "BodyLimitMiddleware",
    "BodyError",
    "BodyReader",
    "BodyTimeout",
    "BodyTooLarge",
    "read_stream",
    "replayed",
]


def _body_timeout() -> float:
    text = os.environ.get("ATROPOS_BODY_TIMEOUT", "").strip()
    try:
        value = float(text) if text else 30.0
    except ValueError:
        value = -1.0
    if not value >= 0:  # also refuses NaN
        logger.warning("ATROPOS_BODY_TIMEOUT=%r is not a number of seconds; using 30", text)
        value = 30.0
    return value


BODY_TIMEOUT = _body_timeout()
"""Seconds a request body may go without receiving a byte before it is dropped (408): 30, or
``ATROPOS_BODY_TIMEOUT`` (the variable that also sets ``run-api --body-timeout``)."""

_SWEEPS = 4
"""Sweeps per timeout: a stall is caught within ``timeout * (1 + 1/_SWEEPS)``."""


class BodyError(Exception):
    """A body that cannot be taken; ``held`` is the budget share it had, to give back."""

    def __init__(self, held: int = 0) -> None:
        super().__init__()
        self.held = held


class BodyTooLarge(BodyError):
    """The body passed ``max_bytes`` (answer 413)."""


class BodyBusy(BodyError):
    """The in-flight budget cannot take the body's next bytes (answer 503 with Retry-After)."""


class BodyTimeout(BodyError):
    """The body received nothing for ``timeout`` seconds (answer 408 and close)."""


class _Read:
    __slots__ = ("task", "seen", "mark", "idle", "expired")

    def __init__(self, task: asyncio.Task | None) -> None:
        self.task = task
        self.seen = 0
        self.mark = -1
        self.idle = 0
        self.expired = False


class BodyReader:
    """Reads ASGI request bodies under a size bound, a shared in-flight budget and a stall timeout.

    ``max_inflight_bytes`` (None: no budget) bounds the bytes of all bodies
    being read or held at once: a chunk that would take the total beyond it
    raises :class:`BodyBusy`, unless the request reading it is the only one
    holding anything (so one body up to ``max_bytes`` is always served).
    ``timeout`` (None or 0: none) is the longest a body may go without a byte.
    """

    def __init__(
        self,
        max_bytes: int,
        max_inflight_bytes: int | None = None,
        timeout: float | None = BODY_TIMEOUT,
    ) -> None:
        self.max_bytes = max_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.timeout = timeout or None
        self.inflight_bytes = 0
        self.timed_out = 0
        self._reads: set[_Read] = set()
        self._sweeper: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------ budget
    def reserve(self, size: int, held: int = 0) -> bool:
        """Charge ``size`` more bytes to a request already holding ``held``; False when refused."""
        limit = self.max_inflight_bytes
        if limit is not None and self.inflight_bytes > held and self.inflight_bytes + size > limit:
            return False
        self.inflight_bytes += size
        return True

    def release(self, held: int) -> None:
        """Give back a request's share of the budget."""
        self.inflight_bytes -= held

    # ------------------------------------------------------------ stall sweep
    def _watch(self, receive: Receive) -> _Read | None:
        """Register a read with the sweep (None when it cannot stall or nothing times out)."""
        if self.timeout is None:
            return None
        # uvicorn's receive is a method of the request's cycle, whose ``more_body`` is False once
        # the whole body is in memory: such a read cannot stall (the usual case, as most bodies
        # arrive with their headers), and skipping the task lookup keeps it cheap.
        if getattr(getattr(receive, "__self__", None), "more_body", True) is False:
            return None
        loop = asyncio.get_running_loop()
        read = _Read(asyncio.current_task(loop))
        self._reads.add(read)
        if self._sweeper is None:
            self._sweeper = loop.call_later(self.timeout / _SWEEPS, self._sweep)
        return read

    def _sweep(self) -> None:
        self._sweeper = None
        for read in list(self._reads):
            if read.seen != read.mark:
                read.mark, read.idle = read.seen, 0
                continue
            read.idle += 1
            if read.idle >= _SWEEPS + 1 and not read.expired and read.task is not None:
                read.expired = True
                read.task.cancel()
        if self._reads and self.timeout is not None:
            loop = asyncio.get_running_loop()
            self._sweeper = loop.call_later(self.timeout / _SWEEPS, self._sweep)

    # ------------------------------------------------------------ reading
    async def read(self, receive: Receive, held: int = 0) -> tuple[bytes | None, int]:
        """The whole body (None when the client left) and the budget share it now holds.

        Raises :class:`BodyTooLarge`, :class:`BodyBusy` or :class:`BodyTimeout`
        (each carrying the share held, for :meth:`release`).
        """
        read = self._watch(receive)
        chunks: list[bytes] = []
        size = 0
        try:
            while True:
                try:
                    message = await receive()
                except asyncio.CancelledError:
                    if read is None or not read.expired:
                        raise
                    if read.task is not None:
                        read.task.uncancel()
                    self.timed_out += 1
                    raise BodyTimeout(held) from None
                if message["type"] == "http.disconnect":
                    return None, held
                chunk = message.get("body", b"")
                if chunk:
                    size += len(chunk)
                    if read is not None:
                        read.seen = size
                    if size > self.max_bytes:
                        raise BodyTooLarge(held)
                    if not self.reserve(len(chunk), held):
                        raise BodyBusy(held)
                    held += len(chunk)
                    chunks.append(chunk)
                if not message.get("more_body", False):
                    return (chunks[0] if len(chunks) == 1 else b"".join(chunks)), held
        finally:
            if read is not None:
                self._reads.discard(read)


async def read_stream(
    chunks: AsyncIterator[bytes], max_bytes: int, timeout: float | None = BODY_TIMEOUT
) -> bytes:
    """Join an async stream of body chunks, at most ``max_bytes``, each within ``timeout`` seconds.

    For servers that read bodies through a framework's stream (Starlette's
    ``request.stream()``) rather than ASGI ``receive``; raises
    :class:`BodyTooLarge` or :class:`BodyTimeout`.
    """
    parts: list[bytes] = []
    size = 0
    iterator = chunks.__aiter__()
    while True:
        try:
            async with asyncio.timeout(timeout):
                chunk = await iterator.__anext__()
        except StopAsyncIteration:
            return b"".join(parts)
        except TimeoutError:
            raise BodyTimeout() from None
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge()
        parts.append(chunk)


def replayed(body: bytes, receive: Receive) -> Receive:
    """An ASGI ``receive`` that returns ``body`` whole once, then defers to ``receive``."""
    sent = False

    async def replay() -> MutableMapping[str, Any]:
        nonlocal sent, body
        if sent:
            return await receive()
        sent = True
        message = {"type": "http.request", "body": body, "more_body": False}
        body = b""  # the app holds the only reference from here on
        return message

    return replay


_CLOSE = (b"connection", b"close")
"""A stalled or refused body is never read to its end: its connection cannot carry another
request."""


class BodyLimitMiddleware:
    """Pure-ASGI middleware reading request bodies under the bounds of :class:`BodyReader`.

    Bodies above ``max_bytes`` get 413 (declared ones before anything is read). With
    ``max_inflight_bytes``, the bodies of all requests being received or processed at once
    are bounded, counting the bytes actually received: a request whose next bytes would take
    the total beyond it gets 503 with ``Retry-After`` (unless it is the only one holding any,
    so a single body up to ``max_bytes`` is always served). A declared ``Content-Length``
    costs nothing until its bytes arrive, and a body that receives nothing for
    ``body_timeout`` seconds is dropped with 408, freeing its share. With ``inflate_gzip``,
    ``Content-Encoding: gzip`` bodies are inflated (bad gzip: 400) and count with their
    inflated size. ``shape`` writes the refusals' bodies; ``hints`` name the settings a
    refusal points to (keys ``size``, ``inflight`` and ``timeout``).

    Example::

        app = BodyLimitMiddleware(app, max_bytes=64 << 20, shape=openai_error_bytes)
    """

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        max_inflight_bytes: int | None = None,
        body_timeout: float | None = BODY_TIMEOUT,
        *,
        inflate_gzip: bool = False,
        shape: ErrorShape = detail_error,
        hints: dict[str, str] | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.reader = BodyReader(max_bytes, max_inflight_bytes, body_timeout)
        self.inflate_gzip = inflate_gzip
        self._shape = shape
        self._hints = {
            "size": "--max-request-mb",
            "inflight": "--max-inflight-mb",
            "timeout": "--body-timeout",
            **(hints or {}),
        }

    @property
    def inflight_bytes(self) -> int:
        """Bytes of request bodies received and not yet released."""
        return self.reader.inflight_bytes

    async def _refuse(self, send: Send, status: int, message: str, *headers: Any) -> None:
        await send_error(send, status, message, shape=self._shape, param="body", headers=headers)

    async def _too_large(self, send: Send, size: int) -> None:
        await self._refuse(
            send,
            413,
            f"request body of {size} bytes exceeds the limit of {self.max_bytes} bytes "
            f"({self._hints['size']})",
            _CLOSE,
        )

    async def _busy(self, send: Send) -> None:
        logger.info("refused a request body: %d bytes already in flight", self.inflight_bytes)
        mb = (self.max_inflight_bytes or 0) // (1024 * 1024)
        await self._refuse(
            send,
            503,
            f"server busy: {self.inflight_bytes} bytes of request bodies in flight "
            f"({self._hints['inflight']} {mb}); retry later",
            (b"retry-after", b"1"),
        )

    async def _timed_out(self, send: Send) -> None:
        logger.info("dropped a request body that received nothing for %ss", self.reader.timeout)
        await self._refuse(
            send,
            408,
            f"request body incomplete: nothing received for {self.reader.timeout:g} seconds "
            f"({self._hints['timeout']})",
            _CLOSE,
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
                    await self._refuse(send, 400, "invalid Content-Length header")
                    return
            elif name == b"content-encoding" and b"gzip" in value.lower():
                gzipped = self.inflate_gzip
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
                return  # the client left
            if gzipped or length is None:
                held = await self._with_length(scope, receive, send, body, gzipped, held)
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

    async def _with_length(
        self, scope: Scope, receive: Receive, send: Send, body: bytes, inflate: bool, held: int
    ) -> int:
        """Pass a chunked or gzipped body on whole with its real length (inflated first when
        ``inflate``); returns the budget share held."""
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
                await send_response(
                    send,
                    400,
                    b"Invalid gzip payload",
                    [(b"content-type", b"text/plain; charset=utf-8")],
                )
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
