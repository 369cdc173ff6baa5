"""A small HTTP/1.1 keep-alive client on asyncio protocols, for plain-``http`` JSON calls.

General clients (httpx, aiohttp) spend hundreds of microseconds of CPU per request on
features a loopback JSON call to an inference server does not use (cookies,
redirects, tracing, middleware). This client does one thing: send a request with a
``Content-Length`` body over a pooled keep-alive connection and read one response
(``Content-Length``, chunked, or read-to-close bodies). Every call has a deadline.

Failures raise ``ConnectionError`` subclasses or ``asyncio.TimeoutError``, which the
server layer treats as "server unavailable". A request whose reused keep-alive
connection turns out to be closed before any answer byte arrived is resent once on a
fresh connection (the server never saw it).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any

logger = logging.getLogger(__name__)

MAX_IDLE_PER_HOST = 512


class StaleConnection(ConnectionResetError):
    """The connection closed before any byte of the answer arrived."""


class _Conn(asyncio.Protocol):
    """One keep-alive connection; at most one request in flight."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future[tuple[int, dict[str, str], bytes]] | None = None
        self.status = 0
        self.headers: dict[str, str] = {}
        self.header_done = False
        self.body_length: int | None = None
        self.chunked = False
        self.keep_alive = True
        self.got_bytes = False
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            if self.header_done and self.body_length is None and not self.chunked:
                waiter.set_result((self.status, self.headers, bytes(self.buffer)))  # read-to-close
            elif not self.got_bytes:
                waiter.set_exception(StaleConnection("connection closed before the answer"))
            else:
                waiter.set_exception(ConnectionResetError(f"connection lost mid-answer: {exc}"))

    def send(self, data: bytes) -> asyncio.Future[tuple[int, dict[str, str], bytes]]:
        loop = asyncio.get_running_loop()
        self.waiter = loop.create_future()
        self.buffer.clear()
        self.status, self.headers, self.header_done = 0, {}, False
        self.body_length, self.chunked, self.got_bytes = None, False, False
        assert self.transport is not None
        self.transport.write(data)
        return self.waiter

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self.buffer += data
        try:
            self._parse()
        except ValueError as e:
            self._fail(ConnectionResetError(f"malformed HTTP answer: {e}"))

    def _fail(self, exc: BaseException) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        self.close()

    def _parse(self) -> None:
        if not self.header_done:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
            version, _, rest = lines[0].partition(" ")
            self.status = int(rest[:3])
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            self.headers = headers
            del self.buffer[: end + 4]
            self.header_done = True
            if "content-length" in headers:
                self.body_length = int(headers["content-length"])
            elif "chunked" in headers.get("transfer-encoding", "").lower():
                self.chunked = True
            elif self.status in (204, 304) or 100 <= self.status < 200:
                self.body_length = 0
            conn = headers.get("connection", "").lower()
            self.keep_alive = conn != "close" and (version != "HTTP/1.0" or conn == "keep-alive")
            if self.body_length is None and not self.chunked:
                self.keep_alive = False  # body ends when the server closes
        if self.chunked:
            body = self._dechunk()
            if body is None:
                return
        elif self.body_length is not None:
            if len(self.buffer) < self.body_length:
                return
            body = bytes(self.buffer[: self.body_length])
        else:
            return
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result((self.status, self.headers, body))

    def _dechunk(self) -> bytes | None:
        out = bytearray()
        pos = 0
        buf = self.buffer
        while True:
            line_end = buf.find(b"\r\n", pos)
            if line_end < 0:
                return None
            size = int(bytes(buf[pos:line_end]).split(b";")[0].strip() or b"0", 16)
            start = line_end + 2
            if size == 0:
                trailer_end = buf.find(b"\r\n\r\n", line_end)
                if trailer_end < 0 and buf[start : start + 2] != b"\r\n":
                    return None
                return bytes(out)
            if len(buf) < start + size + 2:
                return None
            out += buf[start : start + size]
            pos = start + size + 2

    def close(self) -> None:
        self.closed = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


class RawHttpClient:
    """Pooled keep-alive HTTP/1.1 connections to plain-``http`` hosts (one event loop).

    ``await client.request("POST", "127.0.0.1", 8000, "/generate", headers, body, timeout)``
    → ``(status, headers, body)``.
    """

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], collections.deque[_Conn]] = collections.defaultdict(
            collections.deque
        )
        self.loop = asyncio.get_running_loop()

    async def _connect(self, host: str, port: int) -> _Conn:
        _, proto = await self.loop.create_connection(_Conn, host, port)
        return proto

    def _checkout(self, key: tuple[str, int]) -> _Conn | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()  # most recently used: the least likely to have timed out
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    async def request(
        self,
        method: str,
        host: str,
        port: int,
        target: str,
        headers: dict[str, str],
        body: bytes,
        timeout: float,
    ) -> tuple[int, dict[str, str], bytes]:
        """Send one request; the answer's status, lower-cased headers and body."""
        head = [
            f"{method} {target} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Length: {len(body)}\r\n"
        ]
        for name, value in headers.items():
            head.append(f"{name}: {value}\r\n")
        head.append("\r\n")
        data = "".join(head).encode("latin-1") + body
        key = (host, port)
        deadline = self.loop.time() + timeout
        for attempt in (0, 1):
            conn = self._checkout(key) if attempt == 0 else None
            reused = conn is not None
            if conn is None:
                remaining = deadline - self.loop.time()
                if remaining <= 0:
                    raise asyncio.TimeoutError(f"no connection to {host}:{port} within {timeout}s")
                conn = await asyncio.wait_for(self._connect(host, port), remaining)
            waiter = conn.send(data)
            timer = self.loop.call_at(deadline, _expire, waiter, timeout)
            try:
                status, resp_headers, resp_body = await waiter
            except StaleConnection:
                conn.close()
                if reused:
                    continue  # the server closed an idle connection; it never saw this request
                raise
            except BaseException:
                conn.close()  # timed out / cancelled / broken: the connection state is unknown
                raise
            finally:
                timer.cancel()
            if conn.keep_alive and not conn.closed:
                idle = self._idle[key]
                if len(idle) < MAX_IDLE_PER_HOST:
                    idle.append(conn)
                else:
                    conn.close()
            else:
                conn.close()
            return status, resp_headers, resp_body
        raise StaleConnection(f"{host}:{port} closed the connection twice")  # pragma: no cover

    def close(self) -> None:
        """Close every idle connection."""
        for idle in self._idle.values():
            while idle:
                idle.pop().close()
        self._idle.clear()


def _expire(waiter: asyncio.Future[Any], timeout: float) -> None:
    if not waiter.done():
        waiter.set_exception(asyncio.TimeoutError(f"no answer within {timeout}s"))
