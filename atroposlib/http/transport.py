"""One socket write per HTTP answer under uvicorn.

An ASGI server writes an answer's status line and headers when the app sends
``http.response.start`` and its body when the app sends ``http.response.body``:
two ``send`` system calls, two TCP segments and two wake-ups of the client for
every small answer. :class:`CoalescingTransport` holds what is written during
one turn of the event loop and hands it to the real transport at the end of
that turn with one ``writelines`` (a single vectored write on uvloop, no copy),
so an answer sent in one turn leaves in one segment. Nothing waits on a timer:
the pending bytes go out before the loop polls for I/O again.

:func:`http_protocol` gives uvicorn's ``http=`` argument: uvicorn's httptools
protocol with its transport wrapped and a bound on what one connection can make
the server hold (pipelined requests, unsent answers).

Example::

    uvicorn.run(app, host="127.0.0.1", port=8000, http=http_protocol())
"""

from __future__ import annotations

import asyncio
from typing import Any, List

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["MAX_PIPELINED", "CoalescingHttpToolsProtocol", "CoalescingTransport", "http_protocol"]


class CoalescingTransport:
    """A transport whose writes in one event-loop turn reach the socket together.

    Everything but writing is the wrapped transport's: ``close``,
    ``write_eof`` and ``abort`` keep their meaning (the first two send what
    is pending first; ``abort`` drops it, as the transport would).
    """

    __slots__ = ("_transport", "_loop", "_pending")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: List[bytes] | None = None

    def write(self, data: bytes) -> None:
        if not data:
            return
        if self._pending is None:
            self._pending = [data]
            self._loop.call_soon(self._flush)
        else:
            self._pending.append(data)

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def _flush(self) -> None:
        pending, self._pending = self._pending, None
        if pending and not self._transport.is_closing():
            self._transport.writelines(pending)

    def get_write_buffer_size(self) -> int:
        held = sum(map(len, self._pending)) if self._pending else 0
        return self._transport.get_write_buffer_size() + held

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._pending = None
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


MAX_PIPELINED = 32
"""Requests one connection may have parsed and waiting behind the one being answered."""
_SLICE = 65536
"""Bytes parsed at a time once a connection pipelines: bounds what one read can queue."""


class _BoundedFlow(FlowControl):
    """uvicorn's flow control, except that reading resumes only when the connection may read.

    uvicorn resumes reading after every answer and on every ``receive``; a client that
    pipelines requests and never reads the answers would then have all of them parsed
    and queued (about 2 KB each) while their answers pile up.
    """

    def __init__(self, transport: asyncio.Transport, protocol: CoalescingHttpToolsProtocol):
        super().__init__(transport)
        self._protocol = protocol

    def resume_reading(self) -> None:
        if self.read_paused and self._protocol.may_read():
            super().resume_reading()


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol writing each event-loop turn's bytes at once, with a
    bound on what one connection can make the server hold.

    A connection stops being read while it has more than :data:`MAX_PIPELINED`
    requests waiting behind the one being answered, or while its answers are not being
    read (the transport's write buffer is above its high-water mark); what it sent
    meanwhile is parsed when it is read again. So a client that pipelines requests and
    never reads the answers holds at most a few dozen parsed requests, one read of raw
    bytes and the answers in the write buffer, instead of growing the server without
    bound.

    Defined at module level, so that uvicorn's ``--reload`` and ``--workers``
    can pickle a config that names it.
    """

    _held: bytes = b""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]
        self.flow = _BoundedFlow(self.transport, self)

    def may_read(self) -> bool:
        """True when the connection may be read: few requests queued, answers being taken."""
        return not self._held and len(self.pipeline) < MAX_PIPELINED and not self.flow.write_paused

    def data_received(self, data: bytes) -> None:
        if self._held:  # still parsing what came before: keep the order
            self._held += data
            self.flow.pause_reading()
            return
        if len(data) <= _SLICE and len(self.pipeline) < MAX_PIPELINED:
            super().data_received(data)  # the common case: one request, or part of one
            return
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        """Parse ``data`` a slice at a time, holding the rest once the pipeline is full."""
        view = memoryview(data)
        pos = 0
        while pos < len(view):
            if len(self.pipeline) >= MAX_PIPELINED:
                self._held = bytes(view[pos:])
                self.flow.pause_reading()
                return
            super().data_received(view[pos : pos + _SLICE])  # type: ignore[arg-type]
            if self.transport.is_closing() or self.parser is None:
                return  # a bad request was answered 400, or the client left
            pos += _SLICE

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing() or self.parser is None:
            return
        if self._held and len(self.pipeline) < MAX_PIPELINED:
            held, self._held = self._held, b""
            self._feed(held)
        if not self._held:
            self.flow.resume_reading()

    def resume_writing(self) -> None:
        super().resume_writing()
        self.flow.resume_reading()  # reading waited for the answers to be taken


def http_protocol() -> type[CoalescingHttpToolsProtocol]:
    """uvicorn's ``http=`` value: httptools with :class:`CoalescingTransport` and the bounds."""
    return CoalescingHttpToolsProtocol
