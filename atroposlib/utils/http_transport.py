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
protocol with its transport wrapped, or ``"auto"`` (uvicorn's own choice) when
httptools is not installed.

Example::

    uvicorn.run(app, host="127.0.0.1", port=8000, http=http_protocol())
"""

from __future__ import annotations

import asyncio
from typing import Any, List

__all__ = ["CoalescingTransport", "http_protocol"]


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


try:  # uvicorn's httptools protocol; without httptools uvicorn uses h11 by itself
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _HttpTools
except ImportError:  # pragma: no cover - depends on the environment
    _HttpTools = None

if _HttpTools is not None:

    class CoalescingHttpToolsProtocol(_HttpTools):  # type: ignore[misc, valid-type]
        """uvicorn's httptools protocol writing each event-loop turn's bytes at once.

        Defined at module level, so that uvicorn's ``--reload`` and ``--workers``
        can pickle a config that names it.
        """

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]


def http_protocol() -> Any:
    """uvicorn's ``http=`` value: httptools with :class:`CoalescingTransport`, else ``"auto"``."""
    return "auto" if _HttpTools is None else CoalescingHttpToolsProtocol
