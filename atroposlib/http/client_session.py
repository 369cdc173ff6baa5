"""The one HTTP client stack of our processes: ``aiohttp`` sessions with our bounds.

Every asynchronous call we make (an environment's inference calls and rollout-API calls,
the proxy's upstream calls, health probes) goes over an ``aiohttp.ClientSession`` made by
:func:`make_session`. ``aiohttp`` does the HTTP (its llhttp parser, keep-alive pool, TLS,
proxies); this module only configures it and bounds what it reads:

* the environment's proxies: ``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY`` less ``NO_PROXY``
  (:class:`EnvProxies`, read when the session is made, looked up once per URL and handed to
  ``aiohttp`` as each request's ``proxy``; an ``https`` URL behind a proxy is reached with
  ``CONNECT host:443``). Not ``aiohttp``'s ``trust_env``, which looks the proxy and a
  ``.netrc`` up in a worker thread on every request: two thread hops, a few tenths of a
  millisecond of CPU per call;
* TLS certificates verified against the system trust store, which ``SSL_CERT_FILE`` and
  ``SSL_CERT_DIR`` replace (OpenSSL's default paths, read when the session is made);
* answer bodies are read by :func:`read_body`: a declared ``Content-Length`` above the
  limit is refused before the body is read, a streamed body as soon as it passes the limit,
  and a ``gzip``/``deflate`` body is inflated by us (``auto_decompress=False``) never past
  the limit, however far it would inflate (:class:`AnswerTooLarge`);
* headers are bounded by ``aiohttp``'s parser (:data:`MAX_HEADER_LINE`, :data:`MAX_HEADERS`);
* with a ``peer_check``, the host name is resolved here and only the addresses the check
  allows are handed to the connector, so the check holds for the address connected to
  (a name that later resolves elsewhere reaches nothing); such a session should not use
  proxies, whose own resolution the check could not see (``LoopSession(...,
  use_proxies=False)``).

Errors that mean the server answered, wrongly, are this module's (:class:`ProtocolError`);
connection failures and timeouts stay ``aiohttp``'s and ``asyncio``'s, which each user maps
in one place (``envs/server_handling/errors.py``, :mod:`atroposlib.http.httpx_transport`).

    sessions = LoopSession(lambda: make_session(limit=64))
    session = sessions.get()
    async with session.post(url, data=body, proxy=sessions.proxies.for_url(url)) as response:
        payload = await read_body(response, DEFAULT_MAX_ANSWER_BYTES)
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import ssl
import urllib.request
import zlib
from typing import Any, Callable
from urllib.parse import urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

__all__ = [
    "ACCEPT_ENCODING",
    "DEFAULT_MAX_ANSWER_BYTES",
    "AnswerTooLarge",
    "EnvProxies",
    "LoopSession",
    "MalformedAnswer",
    "PeerCheck",
    "PeerRefused",
    "ProtocolError",
    "decode_content",
    "make_session",
    "read_body",
]

DEFAULT_MAX_ANSWER_BYTES = int(
    float(os.environ.get("ATROPOS_MAX_UPSTREAM_ANSWER_MB", "256")) * 1024 * 1024
)
"""Largest answer body read from an inference server (``ATROPOS_MAX_UPSTREAM_ANSWER_MB``)."""

MAX_HEADER_LINE = 16 * 1024
"""Longest status line or header field ``aiohttp``'s parser accepts in an answer."""

MAX_HEADERS = 128
"""Most header fields accepted in one answer."""

ACCEPT_ENCODING = "gzip, deflate"
"""What our sessions offer: the codings :func:`decode_content` undoes within a bound."""

PeerCheck = Callable[[str, str], bool]
"""``check(host, address)``: whether connecting to ``address`` (resolved from ``host``) is
allowed."""


class ProtocolError(RuntimeError):
    """The server answered, but not with what HTTP and the client's bounds allow."""


class AnswerTooLarge(ProtocolError):
    """The server's answer exceeds the client's bound (declared, streamed or inflated)."""


class MalformedAnswer(ProtocolError):
    """The server's answer is not valid HTTP (status line, headers, framing, coding)."""


class PeerRefused(OSError):
    """Every address the host name resolves to is refused by the session's peer check."""


_MAX_CACHED_URLS = 4096


class EnvProxies:
    """The proxy each URL is reached through, from the environment's proxy variables as they
    were when this was made (``urllib``'s reading of them: ``<scheme>_proxy``,
    ``all_proxy``, ``no_proxy``, either case); None for a direct connection."""

    def __init__(self, enabled: bool = True) -> None:
        self._proxies = urllib.request.getproxies_environment() if enabled else {}
        self._cache: dict[str, str | None] = {}

    def __bool__(self) -> bool:
        return any(k != "no" for k in self._proxies)

    def for_url(self, url: str) -> str | None:
        """The proxy URL for ``url``, or None."""
        if not self:
            return None
        try:
            return self._cache[url]
        except KeyError:
            pass
        parts = urlsplit(url)
        proxy = self._proxies.get(parts.scheme) or self._proxies.get("all")
        if proxy and urllib.request.proxy_bypass_environment(parts.netloc, self._proxies):
            proxy = None
        if len(self._cache) < _MAX_CACHED_URLS:
            self._cache[url] = proxy
        return proxy


class _CheckedResolver(AbstractResolver):
    """``aiohttp``'s default resolver, less the addresses the peer check refuses."""

    def __init__(self, check: PeerCheck) -> None:
        self._check = check
        self._inner = aiohttp.ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        allowed = [r for r in results if self._check(host, str(r["host"]))]
        if not allowed:
            addresses = ", ".join(sorted({str(r["host"]) for r in results}))
            raise PeerRefused(f"{host} resolves to {addresses}: not an allowed upstream")
        return allowed

    async def close(self) -> None:
        await self._inner.close()


_TLS_CONTEXTS: dict[tuple[str | None, str | None], ssl.SSLContext] = {}


def _tls_context() -> ssl.SSLContext:
    """The verifying TLS context of the trust store the environment names now
    (``SSL_CERT_FILE``, ``SSL_CERT_DIR``; read when a session is made, not when ``aiohttp``
    was imported). Loading a store costs tens of milliseconds: one context per store."""
    key = (os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
    context = _TLS_CONTEXTS.get(key)
    if context is None:
        context = ssl.create_default_context()
        context.set_alpn_protocols(("http/1.1",))
        _TLS_CONTEXTS[key] = context
    return context


def _check_literal_addresses(check: PeerCheck) -> aiohttp.TraceConfig:
    """A trace that applies ``check`` to a URL naming an IP address (``aiohttp`` connects to
    those without asking the resolver)."""

    async def on_request_start(
        session: aiohttp.ClientSession, context: Any, params: aiohttp.TraceRequestStartParams
    ) -> None:
        host = params.url.raw_host or ""
        try:
            ipaddress.ip_address(host)
        except ValueError:
            return  # a name: the resolver checks the addresses it resolves to
        if not check(host, host):
            raise PeerRefused(f"{host} is not an allowed upstream")

    trace = aiohttp.TraceConfig()
    trace.on_request_start.append(on_request_start)
    return trace


def make_session(
    *,
    limit: int = 0,
    peer_check: PeerCheck | None = None,
    headers: dict[str, str] | None = None,
) -> aiohttp.ClientSession:
    """A session with our configuration (see the module's list); call it in the event loop
    that will use it, and send each request with ``proxy=`` what :class:`EnvProxies` says
    (:class:`LoopSession` keeps both).

    ``limit`` caps the connections open at once (0: no cap; requests beyond it wait for a
    connection); ``headers`` are sent with every request. Timeouts are given per request.
    """
    connector = aiohttp.TCPConnector(
        ssl=_tls_context(),
        limit=limit,
        limit_per_host=0,
        resolver=_CheckedResolver(peer_check) if peer_check is not None else None,
        # The cache would let a name resolved (and checked) once be used for a while;
        # a checked session resolves every new connection.
        use_dns_cache=peer_check is None,
        enable_cleanup_closed=False,
    )
    return aiohttp.ClientSession(
        connector=connector,
        headers={"Accept-Encoding": ACCEPT_ENCODING, **(headers or {})},
        trust_env=False,  # proxies: EnvProxies, per request
        auto_decompress=False,
        max_line_size=MAX_HEADER_LINE,
        max_field_size=MAX_HEADER_LINE,
        max_headers=MAX_HEADERS,
        timeout=aiohttp.ClientTimeout(total=None),
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("User-Agent",),
        trace_configs=[_check_literal_addresses(peer_check)] if peer_check is not None else None,
    )


class LoopSession:
    """One session per event loop: made by ``factory`` on first use in the running loop,
    made anew when the loop changed (connections cannot cross loops)."""

    def __init__(
        self, factory: Callable[[], aiohttp.ClientSession], use_proxies: bool = True
    ) -> None:
        self._factory = factory
        self.use_proxies = use_proxies
        """Whether sessions made from now on go through the environment's proxies."""
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.proxies = EnvProxies(False)
        """The proxies of the current session (read from the environment with it)."""

    def get(self) -> aiohttp.ClientSession:
        """The running loop's session."""
        loop = asyncio.get_running_loop()
        session = self._session
        if session is None or self._loop is not loop or session.closed:
            session = self._session = self._factory()
            self.proxies = EnvProxies(self.use_proxies)
            self._loop = loop
        return session

    async def close(self) -> None:
        """Close the session of the running loop (one of a closed loop is dropped with it)."""
        session, loop = self._session, self._loop
        self._session = self._loop = None
        if session is None or session.closed:
            return
        if loop is asyncio.get_running_loop():
            await session.close()
        elif loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(lambda: loop.create_task(session.close()))


def _too_large(limit: int, what: str) -> AnswerTooLarge:
    return AnswerTooLarge(
        f"the server's answer {what}, more than the limit of {limit / (1024 * 1024):g} MB "
        f"({limit} bytes)"
    )


async def read_body(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body of ``response`` with its ``Content-Encoding`` undone, at most ``limit`` bytes
    (:class:`AnswerTooLarge` beyond it, the connection then dropped)."""
    declared = response.content_length
    if declared is not None and declared > limit:
        response.close()
        raise _too_large(limit, f"declares {declared} bytes")
    if declared is not None:
        body = await response.content.read(declared + 1)  # one call for the common case
        if len(body) == declared and response.content.at_eof():
            return _decoded(response, body, limit)
        parts = [body]
        size = len(body)
    else:
        parts, size = [], 0
    while True:
        chunk = await response.content.readany()
        if not chunk:
            break
        size += len(chunk)
        if size > limit:
            response.close()
            raise _too_large(limit, "exceeds")
        parts.append(chunk)
    return _decoded(response, b"".join(parts), limit)


def _decoded(response: aiohttp.ClientResponse, body: bytes, limit: int) -> bytes:
    coding = response.headers.get("Content-Encoding")
    if not coding:
        return body
    return decode_content(coding, body, limit)


DECODED_ENCODINGS = ("gzip", "x-gzip", "deflate", "identity")
"""The ``Content-Encoding`` values :func:`decode_content` undoes."""


def decode_content(content_encoding: str, body: bytes, limit: int) -> bytes:
    """``body`` with ``content_encoding`` (a header value) undone, never larger than
    ``limit`` bytes: inflating stops as soon as the output would pass it. Broken data or
    another coding raises :class:`MalformedAnswer`."""
    codings = [c.strip().lower() for c in content_encoding.split(",")]
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
            # max_length bounds this call's output: one byte past the limit is enough to
            # know, and the rest of the input is never inflated.
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


def answer_error(exc: aiohttp.ClientResponseError) -> ProtocolError:
    """The :class:`ProtocolError` for ``aiohttp``'s refusal of an answer it could not parse
    (a ``ClientResponseError`` raised before any answer was returned)."""
    text = exc.message or type(exc).__name__
    if "too long" in text.lower() or "too many" in text.lower():
        return MalformedAnswer(f"the server's answer headers exceed the client's bound: {text}")
    return MalformedAnswer(f"malformed HTTP answer: {text}")


def describe(exc: BaseException) -> str:
    """A one-line account of a connection failure, naming TLS certificate verification when
    that is what failed (``aiohttp``'s own message hides the reason in its cause)."""
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        cert = exc.certificate_error
        reason = getattr(cert, "verify_message", None) or str(cert)
        return (
            f"TLS certificate verification failed for {exc.host}:{exc.port}: {reason} "
            "(set SSL_CERT_FILE to a CA bundle that includes the server's CA)"
        )
    if isinstance(exc, aiohttp.ClientConnectorSSLError):
        return f"TLS handshake with {exc.host}:{exc.port} failed: {exc.os_error}"
    if isinstance(exc, aiohttp.ClientHttpProxyError):
        return f"the HTTP proxy refused the connection: {exc.status} {exc.message}"
    if isinstance(exc, aiohttp.ClientConnectorError):
        cause: Any = exc.os_error
        if isinstance(cause, PeerRefused):
            return str(cause)
        return f"{type(cause).__name__}: {cause}" if cause is not None else str(exc)
    return str(exc) or type(exc).__name__
