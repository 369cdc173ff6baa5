"""A small HTTP/1.1 keep-alive client on asyncio protocols, for JSON calls between our processes.

It carries every call to an inference server (``envs/server_handling/_transport.py``) and
every call of an environment to the rollout API (:mod:`atroposlib.http.httpx_transport`,
under ``httpx``).

General clients (httpx, aiohttp) spend hundreds of microseconds of CPU per request on
features a JSON call to an inference server does not use (cookies, redirects, tracing,
middleware). This client does one thing: send a request with a ``Content-Length`` body
over a pooled keep-alive connection (plain TCP, or TLS for ``https``) and read one response
(``Content-Length``, chunked, or read-to-close bodies). Every call has a deadline.

Answers are parsed as they arrive by llhttp (Node's HTTP parser, through ``httptools``),
each byte handed to it once, so an upstream that trickles headers or small chunks costs
time linear in what it sends. Headers are bounded (:data:`MAX_HEADER_BYTES`) and so is the
body (``max_answer_bytes``, default :data:`DEFAULT_MAX_ANSWER_BYTES`): a declared
``Content-Length`` above the bound is refused before its body is read, and a chunked or
read-to-close body is dropped as soon as it passes the bound (:class:`AnswerTooLarge`).
Chunked framing must carry data (chunks beyond the first :data:`FREE_CHUNKS` average at
least :data:`MIN_AVERAGE_CHUNK` bytes), so one-byte chunks cannot make decoding the work.

Interim answers (``100 Continue``, ``103 Early Hints`` ..., up to :data:`MAX_INTERIM_ANSWERS`
in a row) are skipped, as RFC 9110 says: the call's answer is the final one. ``101
Switching Protocols`` is not interim here (this client never asks to switch): it raises
:class:`MalformedAnswer`. Bodies are returned as sent; :func:`decode_content` undoes a
``Content-Encoding`` (gzip, deflate) without ever holding more than a given number of
inflated bytes, so a small compressed answer cannot grow into gigabytes.

Failures are this module's own errors, all :class:`TransportError`, each saying where the
call failed (each user maps them with one table: :mod:`atroposlib.http.httpx_transport` to
``httpx``'s errors, ``envs/server_handling/errors.py`` to the ``openai`` client's):

============================  ===============================================  ===========================
error                         when                                             also a
============================  ===============================================  ===========================
:class:`ConnectError`         no connection: refused, unreachable, unknown     ``ConnectionError``
                              host, TLS handshake, :class:`PeerRefused`
:class:`ConnectTimeout`       no connection within the connect timeout         ``asyncio.TimeoutError``
:class:`ReadError`            the connection broke after the request was       ``ConnectionResetError``
                              sent (reset, closed mid-answer)
:class:`ReadTimeout`          no (complete) answer within the call's timeout   ``asyncio.TimeoutError``
:class:`ProtocolError`        the server answered, wrongly:                    ``RuntimeError``
                              :class:`AnswerTooLarge`, :class:`MalformedAnswer`
============================  ===============================================  ===========================

The builtin bases are the errors this client raised before it had its own, so code that
catches ``OSError`` or ``asyncio.TimeoutError`` still catches the same failures.
A request whose reused keep-alive connection turns out to be closed before any answer
byte arrived is resent once on a fresh connection (the server never saw it).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import ssl
import zlib
from collections.abc import Mapping
from typing import Any, Callable, TypeVar

import httptools

from atroposlib.utils.aio import within

logger = logging.getLogger(__name__)

MAX_IDLE_PER_HOST = 512

MAX_HEADER_BYTES = 64 * 1024
"""Largest status line plus headers accepted (the same order as common servers' limits)."""

DEFAULT_MAX_ANSWER_BYTES = int(
    float(os.environ.get("ATROPOS_MAX_UPSTREAM_ANSWER_MB", "256")) * 1024 * 1024
)
"""Largest answer body read from an inference server (``ATROPOS_MAX_UPSTREAM_ANSWER_MB``)."""

PeerCheck = Callable[[str, str], bool]
"""``check(host, address)``: whether connecting to ``address`` (resolved from ``host``) is
allowed. Given to :class:`RawHttpClient`, it is applied to the address actually connected to."""


class TransportError(Exception):
    """A call of :class:`RawHttpClient` failed; the subclass says where."""


class ConnectError(TransportError, ConnectionError):
    """No connection could be opened, so nothing was sent (the low-level error is the
    cause): refused, unreachable, unknown host, TLS handshake, the peer check."""


class PeerRefused(ConnectError, PermissionError):
    """Every address the host name resolves to is refused by the client's peer check."""


class ConnectTimeout(TransportError, asyncio.TimeoutError):
    """No connection to the server within the connect timeout (nothing was sent)."""


class ReadError(TransportError, ConnectionResetError):
    """The connection broke after the request was sent: reset or closed before the answer
    was complete."""


class StaleConnection(ReadError):
    """The connection closed before any byte of the answer arrived."""


class ReadTimeout(TransportError, asyncio.TimeoutError):
    """No complete answer within the call's timeout."""


class ProtocolError(TransportError, RuntimeError):
    """The server answered, but not with what HTTP/1.1 and the client's bounds allow."""


class AnswerTooLarge(ProtocolError):
    """The server's answer exceeds the client's bound (declared or streamed)."""


class MalformedAnswer(ProtocolError):
    """The server's answer is not valid HTTP/1.1 (bad status line, chunk size, headers)."""


MAX_INTERIM_ANSWERS = 32
"""Interim (1xx) answers skipped before one request's final answer; past it the answer is refused."""

MIN_AVERAGE_CHUNK = 16
"""Chunks beyond the first :data:`FREE_CHUNKS` must carry this many data bytes each on
average, or the answer is refused: no server frames a JSON answer in tinier pieces, and
each chunk costs a call."""

FREE_CHUNKS = 4096


class _Stop(Exception):
    """Raised from a parser callback to stop parsing (the reason is in ``_Conn.error``)."""


class _Conn(asyncio.Protocol):
    """One keep-alive connection; at most one request in flight.

    Answers are parsed by llhttp (``httptools``), incrementally: every byte is handed to
    the parser once. The bounds are checked in its callbacks.
    """

    def __init__(self, max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES) -> None:
        self.transport: asyncio.Transport | None = None
        self.max_answer_bytes = max_answer_bytes
        self.waiter: asyncio.Future[tuple[int, dict[str, str], bytes]] | None = None
        self.bodiless = False
        self.keep_alive = True
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.parser = _new_parser(self)
        self.head_bytes = 0  # bytes fed before the headers were complete
        self.head_parsed = 0  # status line and header bytes the parser handed over
        self.body = bytearray()
        self.status = 0
        self.headers: dict[str, str] = {}
        self.header_done = False
        self.read_to_close = False
        self.chunks = 0
        self.trailer_bytes = 0
        self.error: BaseException | None = None
        self.got_bytes = False
        self.interim = False  # the message being parsed is a 1xx interim answer
        self.interims = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            if self.header_done and self.read_to_close:
                waiter.set_result((self.status, self.headers, bytes(self.body)))
            elif not self.got_bytes:
                waiter.set_exception(StaleConnection("connection closed before the answer"))
            else:
                waiter.set_exception(ReadError(f"connection lost mid-answer: {exc}"))
        self._release()

    def send(
        self, data: bytes, bodiless: bool = False
    ) -> asyncio.Future[tuple[int, dict[str, str], bytes]]:
        """Write a request; the future of its answer. ``bodiless``: the answer has no body
        whatever its headers declare (the answer to ``HEAD``)."""
        loop = asyncio.get_running_loop()
        self.waiter = loop.create_future()
        self._reset()
        self.bodiless = bodiless
        assert self.transport is not None
        self.transport.write(data)
        return self.waiter

    def data_received(self, data: bytes) -> None:
        if self.waiter is None or self.waiter.done():
            self.close()  # bytes nobody asked for: the connection cannot be reused
            return
        self.got_bytes = True
        if not self.header_done:
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except Exception as e:  # noqa: BLE001 - httptools wraps callback errors; sorted below
            self._fail(self.error or MalformedAnswer(f"malformed HTTP answer: {e}"))
            return
        if not self.header_done and self.head_bytes > MAX_HEADER_BYTES:
            self._fail(MalformedAnswer(f"answer headers exceed {MAX_HEADER_BYTES} bytes"))

    # ----------------------------------------------------------------- parser callbacks
    def _stop(self, error: BaseException) -> None:
        self.error = error
        raise _Stop(str(error))

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.header_done:  # a trailer
            self.trailer_bytes += len(name) + len(value)
            if self.trailer_bytes > MAX_HEADER_BYTES:
                self._stop(MalformedAnswer(f"answer trailers exceed {MAX_HEADER_BYTES} bytes"))
            return
        # The bound on the header block itself: one read can carry it whole, body included,
        # and completes it before data_received's count of the bytes read so far is checked.
        # (Counted inline: this runs for every header of every answer.)
        self.head_parsed += len(name) + len(value) + 4
        if self.head_parsed > MAX_HEADER_BYTES:
            self._head_too_large()
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1").strip()

    def on_status(self, reason: bytes) -> None:
        self.head_parsed += len(reason) + 15
        if self.head_parsed > MAX_HEADER_BYTES:
            self._head_too_large()

    def _head_too_large(self) -> None:
        self._stop(MalformedAnswer(f"answer headers exceed {MAX_HEADER_BYTES} bytes"))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            if status == 101:
                self._stop(
                    MalformedAnswer("the server answered 101 Switching Protocols to plain HTTP/1.1")
                )
            # An interim answer (100 Continue, 103 Early Hints): skipped, the final one
            # follows. Counted, so a server cannot keep the call busy with them for ever.
            self.interims += 1
            if self.interims > MAX_INTERIM_ANSWERS:
                self._stop(
                    MalformedAnswer(f"more than {MAX_INTERIM_ANSWERS} interim (1xx) answers")
                )
            self.interim = True
            self.headers = {}
            return
        self.header_done = True
        self.status = status
        self.keep_alive = self.parser.should_keep_alive()
        if self.bodiless:
            # The parser cannot be told that no body follows: answer now, never reuse.
            self.keep_alive = False
            self.on_message_complete()
            raise _Stop("the answer to HEAD ends with its headers")
        headers = self.headers
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        declared = headers.get("content-length")
        if not chunked and declared is not None:
            if declared.isascii() and declared.isdigit() and int(declared) > self.max_answer_bytes:
                self._stop(self._too_large(int(declared)))
        elif not chunked and self.status not in (204, 304):
            self.read_to_close = True  # the body ends when the server closes
            self.keep_alive = False

    def on_chunk_complete(self) -> None:
        self.chunks += 1
        paid = self.chunks - FREE_CHUNKS  # chunks beyond the free ones must carry data
        if paid > 0 and len(self.body) < paid * MIN_AVERAGE_CHUNK:
            self._stop(
                MalformedAnswer(
                    f"answer framed in {self.chunks} chunks averaging under "
                    f"{MIN_AVERAGE_CHUNK} bytes beyond the first {FREE_CHUNKS}"
                )
            )

    def on_body(self, data: bytes) -> None:
        if len(self.body) + len(data) > self.max_answer_bytes:
            self._stop(self._too_large())
        self.body += data

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result((self.status, self.headers, bytes(self.body)))
        self.body = bytearray()

    # -----------------------------------------------------------------
    def _too_large(self, declared: int | None = None) -> AnswerTooLarge:
        what = f"declares {declared} bytes" if declared is not None else "exceeds"
        limit_mb = self.max_answer_bytes / (1024 * 1024)
        return AnswerTooLarge(
            f"the server's answer {what}, more than the limit of {limit_mb:g} MB "
            f"({self.max_answer_bytes} bytes)"
        )

    def _fail(self, exc: BaseException) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        self.close()

    def _release(self) -> None:
        # Drop the partial answer now: a failed request's exception (and this connection
        # with it) may be kept by a traceback for a while, and retries would each add one.
        self.body = bytearray()
        self.parser = None  # type: ignore[assignment]

    def close(self) -> None:
        self.closed = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
        else:
            self._release()


DECODED_ENCODINGS = ("gzip", "x-gzip", "deflate", "identity")
"""The ``Content-Encoding`` values :func:`decode_content` undoes."""

ACCEPT_ENCODING = "gzip, deflate"
"""What a client that answers through :func:`decode_content` may accept."""


def decode_content(headers: dict[str, str], body: bytes, limit: int) -> bytes:
    """``body`` with its ``Content-Encoding`` (lower-cased ``headers``) undone, never larger
    than ``limit`` bytes.

    Codings are undone last first (``gzip``/``x-gzip``, ``deflate`` with or without its zlib
    wrapper, ``identity``). Inflating stops as soon as the output would pass ``limit``:
    :class:`AnswerTooLarge` names the limit, and memory holds at most ``limit`` bytes of
    output, however far the data would inflate. Broken data or another coding raises
    :class:`MalformedAnswer`.
    """
    codings = [c.strip().lower() for c in headers.get("content-encoding", "").split(",")]
    for coding in reversed([c for c in codings if c]):
        if coding == "identity":
            continue
        if coding in ("gzip", "x-gzip"):
            body = _inflate(body, 16 + zlib.MAX_WBITS, limit, coding)
        elif coding == "deflate":
            try:  # RFC 9110's deflate is zlib-wrapped; some servers send it raw
                body = _inflate(body, zlib.MAX_WBITS, limit, coding)
            except MalformedAnswer:
                body = _inflate(body, -zlib.MAX_WBITS, limit, coding)
        else:
            raise MalformedAnswer(
                f"unsupported Content-Encoding {coding!r} (this client decodes "
                f"{', '.join(DECODED_ENCODINGS)})"
            )
    return body


def _inflate(data: bytes, wbits: int, limit: int, coding: str) -> bytes:
    """Inflate ``data`` (every member of a multi-member gzip), at most ``limit`` bytes."""
    out = bytearray()
    while True:
        inflater = zlib.decompressobj(wbits)
        try:
            # max_length bounds the output of this call: one byte past the limit is enough
            # to know, and the rest of the input is never inflated.
            out += inflater.decompress(data, limit - len(out) + 1)
        except zlib.error as e:
            raise MalformedAnswer(f"the server's {coding} answer is not valid: {e}") from None
        if len(out) > limit:
            raise AnswerTooLarge(
                f"the server's {coding} answer inflates past the limit of "
                f"{limit / (1024 * 1024):g} MB ({limit} bytes); {len(data)} bytes compressed"
            )
        if not inflater.eof:
            raise MalformedAnswer(f"the server's {coding} answer is truncated")
        data = inflater.unused_data
        if wbits < 16 or not data:  # only gzip has members
            return bytes(out)


def _new_parser(conn: _Conn) -> Any:
    return httptools.HttpResponseParser(conn)


def _host_header(host: str, port: int, tls: bool) -> str:
    name = f"[{host}]" if ":" in host else host
    return name if port == (443 if tls else 80) else f"{name}:{port}"


class RawHttpClient:
    """Pooled keep-alive HTTP/1.1 connections to ``http`` and ``https`` hosts (one event loop).

    ``await client.request("POST", "127.0.0.1", 8000, "/generate", headers, body, timeout)``
    → ``(status, headers, body)``; ``tls=True`` speaks TLS (certificates verified against the
    system's trust store, as ``ssl.create_default_context()`` sets it up). ``host`` is a name
    or an address (IPv6 without brackets). ``max_answer_bytes`` bounds each answer body;
    ``peer_check(host, address)``, when given, is asked about every address the host resolves
    to, and only allowed addresses are connected to (the check holds for the address actually
    used, not for a name resolved earlier).
    """

    def __init__(
        self,
        max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
        peer_check: PeerCheck | None = None,
    ) -> None:
        self._idle: dict[tuple[str, int, bool], collections.deque[_Conn]] = collections.defaultdict(
            collections.deque
        )
        self.loop = asyncio.get_running_loop()
        self.max_answer_bytes = int(max_answer_bytes)
        self.peer_check = peer_check
        self._tls: ssl.SSLContext | None = None

    def _protocol(self) -> _Conn:
        return _Conn(self.max_answer_bytes)

    def _tls_options(self, host: str, tls: bool) -> dict[str, Any]:
        if not tls:
            return {}
        if self._tls is None:  # loading the trust store costs milliseconds: once per client
            self._tls = ssl.create_default_context()
        return {"ssl": self._tls, "server_hostname": host}

    async def _connect(self, host: str, port: int, tls: bool = False) -> _Conn:
        options = self._tls_options(host, tls)
        if self.peer_check is None:
            _, proto = await self.loop.create_connection(self._protocol, host, port, **options)
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
                    self._protocol,
                    address[0],
                    address[1],
                    family=family,
                    proto=proto_num,
                    **options,
                )
                return proto
            except OSError as e:  # try the next allowed address
                last = e
        assert last is not None
        raise last

    def _checkout(self, key: tuple[str, int, bool]) -> _Conn | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()  # most recently used: the least likely to have timed out
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    async def _open(self, host: str, port: int, tls: bool, within_s: float) -> _Conn:
        """A fresh connection; :class:`ConnectTimeout` after ``within_s``, :class:`ConnectError`
        for any other failure (asyncio's combined ``OSError("Multiple exceptions...")`` of a
        name whose every address refuses, a bare ``OSError`` for an unreachable network)."""
        try:
            return await within(self._connect(host, port, tls), within_s)
        except (asyncio.TimeoutError, TimeoutError):  # ours, or the system's (ETIMEDOUT)
            raise ConnectTimeout(f"no connection to {host}:{port} within {within_s:.3g}s") from None
        except ConnectError:
            raise
        except OSError as e:  # refused, unreachable, unknown host, TLS
            raise ConnectError(f"{type(e).__name__}: {e}") from e

    async def request(
        self,
        method: str,
        host: str,
        port: int,
        target: str,
        headers: dict[str, str],
        body: bytes,
        timeout: float,
        tls: bool = False,
        connect_timeout: float | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        """Send one request; the answer's status, lower-cased headers and body.

        ``timeout`` bounds the whole call; ``connect_timeout``, when given, also bounds
        opening a connection (:class:`ConnectTimeout` when it runs out). Failures are
        :class:`TransportError` subclasses (see the module's table).
        """
        head = [
            f"{method} {target} HTTP/1.1\r\nHost: {_host_header(host, port, tls)}\r\n"
            f"Content-Length: {len(body)}\r\n"
        ]
        for name, value in headers.items():
            head.append(f"{name}: {value}\r\n")
        head.append("\r\n")
        data = "".join(head).encode("latin-1") + body
        key = (host, port, tls)
        deadline = self.loop.time() + timeout
        for attempt in (0, 1):
            conn = self._checkout(key) if attempt == 0 else None
            reused = conn is not None
            if conn is None:
                remaining = deadline - self.loop.time()
                if connect_timeout is not None:
                    remaining = min(remaining, connect_timeout)
                if remaining <= 0:
                    raise ConnectTimeout(f"no connection to {host}:{port} within {timeout}s")
                conn = await self._open(host, port, tls, remaining)
            waiter = conn.send(data, bodiless=method == "HEAD")
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


class LoopClient:
    """One :class:`RawHttpClient` per event loop: made by ``factory`` on first use in the
    running loop, made anew when the loop changed (connections cannot cross loops).

        clients = LoopClient(lambda: RawHttpClient(max_answer_bytes=1 << 20))
        status, headers, body = await clients.get().request(...)
    """

    def __init__(self, factory: Callable[[], RawHttpClient]) -> None:
        self._factory = factory
        self._client: RawHttpClient | None = None

    def get(self) -> RawHttpClient:
        """The running loop's client."""
        client = self._client
        if client is None or client.loop is not asyncio.get_running_loop():
            client = self._client = self._factory()
        return client

    def close(self) -> None:
        """Close the idle connections (those of a closed loop are dropped with it)."""
        client, self._client = self._client, None
        if client is not None and not client.loop.is_closed():
            client.close()


E = TypeVar("E")


def error_for(exc: TransportError, table: Mapping[type[TransportError], E]) -> E | None:
    """What ``table`` maps ``exc`` to: the entry of the most specific class ``exc`` is an
    instance of (its own class first, then its bases in method resolution order), or None.
    Users map this module's errors with such a table, in any order of its entries."""
    for cls in type(exc).__mro__:
        if cls in table:
            return table[cls]  # type: ignore[index]
    return None


def _expire(waiter: asyncio.Future[Any], timeout: float) -> None:
    if not waiter.done():
        waiter.set_exception(ReadTimeout(f"no answer within {timeout}s"))
