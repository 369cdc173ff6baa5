"""A small HTTP/1.1 keep-alive client on asyncio protocols, for plain-``http`` JSON calls.

General clients (httpx, aiohttp) spend hundreds of microseconds of CPU per request on
features a loopback JSON call to an inference server does not use (cookies,
redirects, tracing, middleware). This client does one thing: send a request with a
``Content-Length`` body over a pooled keep-alive connection and read one response
(``Content-Length``, chunked, or read-to-close bodies). Every call has a deadline.

The answer is parsed as it arrives, each byte looked at once: the header search resumes
where the last read stopped and chunked bodies are decoded by a state machine, so an
upstream that trickles headers or one-byte chunks costs time linear in what it sends.
Headers are bounded (:data:`MAX_HEADER_BYTES`) and so is the body (``max_answer_bytes``,
default :data:`DEFAULT_MAX_ANSWER_BYTES`): a declared ``Content-Length`` above the bound
is refused before its body is read, and a chunked or read-to-close body is dropped as soon
as it passes the bound (:class:`AnswerTooLarge`).

Failures raise ``ConnectionError`` subclasses or ``asyncio.TimeoutError``, which the
server layer treats as "server unavailable"; an answer that is too large or malformed
raises :class:`AnswerTooLarge` / :class:`MalformedAnswer` (the server answered, wrongly).
A request whose reused keep-alive connection turns out to be closed before any answer
byte arrived is resent once on a fresh connection (the server never saw it).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import re
import socket
from typing import Any, Callable

logger = logging.getLogger(__name__)

MAX_IDLE_PER_HOST = 512

MAX_HEADER_BYTES = 64 * 1024
"""Largest status line plus headers accepted (the same order as common servers' limits)."""

MAX_CHUNK_LINE = 4096
"""Largest chunk-size line (size and extensions) or trailer line accepted."""

DEFAULT_MAX_ANSWER_BYTES = int(
    float(os.environ.get("ATROPOS_MAX_UPSTREAM_ANSWER_MB", "256")) * 1024 * 1024
)
"""Largest answer body read from an inference server (``ATROPOS_MAX_UPSTREAM_ANSWER_MB``)."""

PeerCheck = Callable[[str, str], bool]
"""``check(host, address)``: whether connecting to ``address`` (resolved from ``host``) is
allowed. Given to :class:`RawHttpClient`, it is applied to the address actually connected to."""


class StaleConnection(ConnectionResetError):
    """The connection closed before any byte of the answer arrived."""


class AnswerTooLarge(RuntimeError):
    """The server's answer exceeds the client's bound (declared or streamed)."""


class MalformedAnswer(RuntimeError):
    """The server's answer is not valid HTTP/1.1 (bad status line, chunk size, headers)."""


class PeerRefused(PermissionError):
    """Every address the host name resolves to is refused by the client's peer check."""


_SIZE, _DATA, _DATA_END, _TRAILER, _DONE = range(5)
_CHUNK_SIZE = re.compile(rb"([0-9a-fA-F]{1,16})[ \t]*(?:;[^\r\n]{0,%d})?\r\n" % MAX_CHUNK_LINE)


class _Conn(asyncio.Protocol):
    """One keep-alive connection; at most one request in flight."""

    def __init__(self, max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES) -> None:
        self.transport: asyncio.Transport | None = None
        self.max_answer_bytes = max_answer_bytes
        self.waiter: asyncio.Future[tuple[int, dict[str, str], bytes]] | None = None
        self.keep_alive = True
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.head = bytearray()  # status line and headers until the blank line
        self.scanned = 0  # how far ``head`` has been searched for the blank line
        self.body = bytearray()
        self.pending = bytearray()  # chunked framing not yet complete (a size line, a CRLF)
        self.status = 0
        self.headers: dict[str, str] = {}
        self.header_done = False
        self.body_length: int | None = None
        self.chunked = False
        self.chunk_state = _SIZE
        self.chunk_left = 0
        self.trailer_bytes = 0
        self.got_bytes = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            if self.header_done and self.body_length is None and not self.chunked:
                waiter.set_result((self.status, self.headers, bytes(self.body)))  # read-to-close
            elif not self.got_bytes:
                waiter.set_exception(StaleConnection("connection closed before the answer"))
            else:
                waiter.set_exception(ConnectionResetError(f"connection lost mid-answer: {exc}"))

    def send(self, data: bytes) -> asyncio.Future[tuple[int, dict[str, str], bytes]]:
        loop = asyncio.get_running_loop()
        self.waiter = loop.create_future()
        self._reset()
        assert self.transport is not None
        self.transport.write(data)
        return self.waiter

    def data_received(self, data: bytes) -> None:
        if self.waiter is None or self.waiter.done():
            self.close()  # bytes nobody asked for: the connection cannot be reused
            return
        self.got_bytes = True
        try:
            self._feed(data)
        except (AnswerTooLarge, MalformedAnswer) as e:
            self._fail(e)
        except ValueError as e:  # int() of a bad status or length
            self._fail(MalformedAnswer(f"malformed HTTP answer: {e}"))

    def _fail(self, exc: BaseException) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        self.close()

    def _finish(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result((self.status, self.headers, bytes(self.body)))

    def _feed(self, data: bytes) -> None:
        if not self.header_done:
            self.head += data
            # Resume the search where the last one stopped (a terminator may straddle reads).
            end = self.head.find(b"\r\n\r\n", max(0, self.scanned - 3))
            if end < 0:
                self.scanned = len(self.head)
                if len(self.head) > MAX_HEADER_BYTES:
                    raise MalformedAnswer(f"answer headers exceed {MAX_HEADER_BYTES} bytes")
                return
            if end > MAX_HEADER_BYTES:
                raise MalformedAnswer(f"answer headers exceed {MAX_HEADER_BYTES} bytes")
            rest = bytes(self.head[end + 4 :])
            self._parse_head(bytes(self.head[:end]))
            self.head = bytearray()
            data = rest
            if self.body_length == 0:
                self._finish()
                return
        if self.chunked:
            self._feed_chunked(data)
        elif self.body_length is not None:
            self.body += data[: self.body_length - len(self.body)]
            if len(self.body) >= self.body_length:
                self._finish()
        else:
            if len(self.body) + len(data) > self.max_answer_bytes:
                raise self._too_large()
            self.body += data

    def _too_large(self, declared: int | None = None) -> AnswerTooLarge:
        what = f"declares {declared} bytes" if declared is not None else "exceeds"
        limit_mb = self.max_answer_bytes / (1024 * 1024)
        return AnswerTooLarge(
            f"the server's answer {what}, more than the limit of {limit_mb:g} MB "
            f"({self.max_answer_bytes} bytes)"
        )

    def _parse_head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
            raise MalformedAnswer(f"malformed HTTP status line {lines[0][:100]!r}")
        self.status = int(rest[:3])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        self.headers = headers
        self.header_done = True
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self.chunked = True  # chunked framing wins over a Content-Length (RFC 9112 6.3)
        elif "content-length" in headers:
            declared = headers["content-length"]
            if not declared.isascii() or not declared.isdigit() or len(declared) > 20:
                raise MalformedAnswer(f"malformed Content-Length {declared[:30]!r}")
            self.body_length = int(declared)
            if self.body_length > self.max_answer_bytes:
                raise self._too_large(self.body_length)
        elif self.status in (204, 304) or 100 <= self.status < 200:
            self.body_length = 0
        conn = headers.get("connection", "").lower()
        self.keep_alive = conn != "close" and (version != "HTTP/1.0" or conn == "keep-alive")
        if self.body_length is None and not self.chunked:
            self.keep_alive = False  # body ends when the server closes

    def _feed_chunked(self, data: bytes) -> None:
        # One pass over ``pending`` (an incomplete frame, at most a framing line long) plus
        # the new bytes: every byte is looked at once, however small the chunks are.
        buf = bytes(self.pending) + data if self.pending else data
        pos, n = 0, len(buf)
        state, body, limit = self.chunk_state, self.body, self.max_answer_bytes
        size_line = _CHUNK_SIZE.match
        while pos < n:
            if state == _SIZE:
                # Fast path: whole chunks in this buffer, one regex match and one slice each.
                while True:
                    m = size_line(buf, pos)
                    if m is None:
                        break
                    size = int(m.group(1), 16)
                    start = m.end()
                    end = start + size
                    if size == 0 or end + 2 > n:
                        break
                    if buf[end : end + 2] != b"\r\n":
                        raise MalformedAnswer("chunk data longer than its declared size")
                    if len(body) + size > limit:
                        raise self._too_large()
                    body += buf[start:end]
                    pos = end + 2
                if pos >= n:
                    break
                m = size_line(buf, pos)
                if m is None:
                    if buf.find(b"\r\n", pos) >= 0 or n - pos > MAX_CHUNK_LINE:
                        raise MalformedAnswer(f"malformed chunk size line {buf[pos : pos + 40]!r}")
                    break  # the size line is not complete yet
                size = int(m.group(1), 16)
                pos = m.end()
                if size == 0:
                    state = _TRAILER
                elif len(body) + size > limit:
                    raise self._too_large()
                else:
                    state, self.chunk_left = _DATA, size
            elif state == _DATA:
                take = min(self.chunk_left, n - pos)
                body += buf[pos : pos + take]
                pos += take
                self.chunk_left -= take
                if self.chunk_left == 0:
                    state = _DATA_END
            elif state == _DATA_END:
                if n - pos < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise MalformedAnswer("chunk data longer than its declared size")
                pos += 2
                state = _SIZE
            else:  # trailers, up to an empty line
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if n - pos > MAX_CHUNK_LINE:
                        raise MalformedAnswer(f"chunk trailer exceeds {MAX_CHUNK_LINE} bytes")
                    break
                if end == pos:
                    self.chunk_state = _DONE
                    self.pending = bytearray()
                    self._finish()
                    return
                self.trailer_bytes += end - pos
                if self.trailer_bytes > MAX_HEADER_BYTES:
                    raise MalformedAnswer(f"answer trailers exceed {MAX_HEADER_BYTES} bytes")
                pos = end + 2
        self.chunk_state = state
        self.pending = bytearray(buf[pos:])

    def close(self) -> None:
        self.closed = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


def _host_header(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class RawHttpClient:
    """Pooled keep-alive HTTP/1.1 connections to plain-``http`` hosts (one event loop).

    ``await client.request("POST", "127.0.0.1", 8000, "/generate", headers, body, timeout)``
    → ``(status, headers, body)``. ``host`` is a name or an address (IPv6 without
    brackets). ``max_answer_bytes`` bounds each answer body; ``peer_check(host, address)``,
    when given, is asked about every address the host resolves to, and only allowed
    addresses are connected to (the check holds for the address actually used, not for a
    name resolved earlier).
    """

    def __init__(
        self,
        max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
        peer_check: PeerCheck | None = None,
    ) -> None:
        self._idle: dict[tuple[str, int], collections.deque[_Conn]] = collections.defaultdict(
            collections.deque
        )
        self.loop = asyncio.get_running_loop()
        self.max_answer_bytes = int(max_answer_bytes)
        self.peer_check = peer_check

    def _protocol(self) -> _Conn:
        return _Conn(self.max_answer_bytes)

    async def _connect(self, host: str, port: int) -> _Conn:
        if self.peer_check is None:
            _, proto = await self.loop.create_connection(self._protocol, host, port)
            return proto
        infos = await self.loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        allowed = [info for info in infos if self.peer_check(host, str(info[4][0]))]
        if not allowed:
            addresses = sorted({str(info[4][0]) for info in infos})
            raise PeerRefused(f"{host} resolves to {', '.join(addresses)}: not an allowed upstream")
        last: OSError | None = None
        for family, _, proto_num, _, address in allowed:
            try:
                _, proto = await self.loop.create_connection(
                    self._protocol, address[0], address[1], family=family, proto=proto_num
                )
                return proto
            except OSError as e:  # try the next allowed address
                last = e
        assert last is not None
        raise last

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
            f"{method} {target} HTTP/1.1\r\nHost: {_host_header(host, port)}\r\n"
            f"Content-Length: {len(body)}\r\n"
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
