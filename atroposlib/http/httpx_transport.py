"""``httpx`` over our keep-alive client: the transport of an environment's rollout-API client.

An environment posts scored groups and polls ``/status-env`` hundreds of times a second at
full speed; under ``httpx``'s own transport (``httpcore``) each call costs several hundred
microseconds of CPU in connection-pool and protocol bookkeeping. :class:`RawHttpTransport`
is an ``httpx.AsyncBaseTransport`` that sends each request over
:class:`~atroposlib.http.client.RawHttpClient` instead, so the client keeps ``httpx``'s
interface (``Response``, ``raise_for_status``, its exception types) at a fraction of the cost.

What it keeps from ``httpx``'s transport:

* at most ``max_connections`` requests in flight (8 by default); a request that waits
  longer than the ``pool`` timeout for its turn raises ``httpx.PoolTimeout``;
* the ``connect`` timeout bounds opening a connection; the largest of the ``read`` and
  ``write`` timeouts bounds the rest of the call (sending and the whole answer), where
  ``httpcore`` bounds each read and write;
* failures as ``httpx`` exceptions, mapped here and nowhere else, by one table
  (:data:`HTTPX_ERRORS`) from the client's own: no connection (refused, unknown host, TLS
  failure, an address the peer check refuses) → ``httpx.ConnectError``, none in time →
  ``httpx.ConnectTimeout``; the connection lost during the call → ``httpx.ReadError``; no
  answer in time → ``httpx.ReadTimeout``; an answer that is not valid HTTP/1.1 or exceeds
  ``max_answer_bytes`` (sent, or once its ``Content-Encoding`` is undone:
  :func:`~atroposlib.http.client.decode_content`) → ``httpx.RemoteProtocolError``;
* what ``h11`` refuses to send: a method or header name that is not a token, a header value
  with CR, LF or NUL → ``httpx.LocalProtocolError``, nothing sent.

Where it differs: it decodes gzip and deflate answers itself, within ``max_answer_bytes``
(``httpx``'s decoders inflate without a bound), and offers only those; an answer's repeated header keeps its last value only (the rollout API
sends none twice), and the ``Host`` header is always the URL's. It does not speak to HTTP
proxies: a client whose URL the environment's proxy variables
(``HTTP_PROXY``, ``HTTPS_PROXY``, ``ALL_PROXY``, less ``NO_PROXY``) route through a proxy
uses ``httpx``'s own transport (:func:`proxied`).

Example::

    async with httpx.AsyncClient(transport=RawHttpTransport()) as client:
        response = await client.get("http://127.0.0.1:8000/status")
"""

from __future__ import annotations

import asyncio
import re
import urllib.request
from typing import Any
from urllib.parse import urlsplit

import httpx

from atroposlib.http import client as raw_errors
from atroposlib.http.client import (
    ACCEPT_ENCODING,
    DECODED_ENCODINGS,
    DEFAULT_MAX_ANSWER_BYTES,
    LoopClient,
    RawHttpClient,
    TransportError,
    decode_content,
    error_for,
)
from atroposlib.utils.aio import within

__all__ = ["HTTPX_ERRORS", "RawHttpTransport", "proxied"]

_NO_DEADLINE_S = 365 * 24 * 3600.0
_SET_BY_CLIENT = frozenset({"host", "content-length", "transfer-encoding"})
# What h11 (httpx's own transport) refuses to send: a method or header name that is not a
# token, a header value with CR, LF or NUL (caller's data must not write lines of its own).
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_BAD_VALUE = re.compile(r"[\r\n\x00]")


HTTPX_ERRORS: dict[type[TransportError], type[httpx.TransportError]] = {
    raw_errors.ConnectError: httpx.ConnectError,
    raw_errors.ConnectTimeout: httpx.ConnectTimeout,
    raw_errors.ReadError: httpx.ReadError,
    raw_errors.ReadTimeout: httpx.ReadTimeout,
    raw_errors.ProtocolError: httpx.RemoteProtocolError,
}
"""The ``httpx`` error each of the keep-alive client's errors becomes (the most specific
entry for an error's class wins: :func:`~atroposlib.http.client.error_for`)."""


def _httpx_error(exc: TransportError, request: httpx.Request) -> httpx.TransportError:
    """``exc`` as the ``httpx`` error :data:`HTTPX_ERRORS` names for it."""
    cls = error_for(exc, HTTPX_ERRORS) or httpx.TransportError
    return cls(str(exc) or type(exc).__name__, request=request)


def proxied(url: str) -> bool:
    """Whether the environment's proxy variables send requests to ``url`` through a proxy."""
    parts = urlsplit(url)
    proxies = urllib.request.getproxies()
    if not (proxies.get(parts.scheme) or proxies.get("all")):
        return False
    return not urllib.request.proxy_bypass(parts.netloc)


def _acceptable(accept_encoding: str) -> str:
    """``accept_encoding`` less the codings :func:`decode_content` does not undo."""
    offered = [c.strip() for c in accept_encoding.split(",")]
    kept = [c for c in offered if c.split(";")[0].strip().lower() in DECODED_ENCODINGS]
    return ", ".join(kept) or ACCEPT_ENCODING


def _seconds(value: Any) -> float:
    return _NO_DEADLINE_S if value is None else float(value)


class RawHttpTransport(httpx.AsyncBaseTransport):
    """Sends ``httpx`` requests over :class:`~atroposlib.http.client.RawHttpClient`.

    One keep-alive client per event loop (created on first use, like ``httpx``'s pool it
    must not be shared across loops); ``max_answer_bytes`` bounds each answer's body.
    """

    def __init__(
        self, max_connections: int = 8, max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self.max_connections = int(max_connections)
        self.max_answer_bytes = int(max_answer_bytes)
        self._raw = LoopClient(lambda: RawHttpClient(self.max_answer_bytes))
        self._slots: tuple[RawHttpClient, asyncio.Semaphore] | None = None

    def _client(self) -> tuple[RawHttpClient, asyncio.Semaphore]:
        """The running loop's client and its slots (both made anew for a new loop)."""
        raw = self._raw.get()
        if self._slots is None or self._slots[0] is not raw:
            self._slots = (raw, asyncio.Semaphore(self.max_connections))
        return self._slots

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme not in ("http", "https"):
            raise httpx.UnsupportedProtocol(
                f"unsupported URL scheme {url.scheme!r}: expected http or https", request=request
            )
        tls = url.scheme == "https"
        body = await request.aread()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _SET_BY_CLIENT}
        if not _TOKEN.fullmatch(request.method):
            raise httpx.LocalProtocolError(f"illegal method {request.method!r}", request=request)
        for name, value in headers.items():
            if not _TOKEN.fullmatch(name) or _BAD_VALUE.search(value):
                raise httpx.LocalProtocolError(
                    f"illegal header {name!r}: {value!r}", request=request
                )
        if "accept-encoding" in headers:  # httpx offers what it decodes (br, zstd): we decode
            headers["accept-encoding"] = _acceptable(headers["accept-encoding"])
        timeouts = request.extensions.get("timeout", {})
        call_s = max(_seconds(timeouts.get("read")), _seconds(timeouts.get("write")))
        connect_s = _seconds(timeouts.get("connect"))
        raw, slots = self._client()
        if slots.locked():
            try:
                await within(slots.acquire(), _seconds(timeouts.get("pool")))
            except asyncio.TimeoutError:
                raise httpx.PoolTimeout(
                    f"all {self.max_connections} connections stayed busy", request=request
                ) from None
        else:
            await slots.acquire()
        try:
            status, answer_headers, answer = await raw.request(
                request.method,
                url.host,
                url.port or (443 if tls else 80),
                url.raw_path.decode("ascii"),
                headers,
                body,
                call_s,
                tls,
                connect_timeout=connect_s,
            )
            if "content-encoding" in answer_headers:
                answer = decode_content(answer_headers, answer, self.max_answer_bytes)
                del answer_headers["content-encoding"]
                answer_headers["content-length"] = str(len(answer))
        except TransportError as e:
            raise _httpx_error(e, request) from e
        finally:
            slots.release()
        return httpx.Response(
            status,
            headers=list(answer_headers.items()),
            stream=httpx.ByteStream(answer),
            request=request,
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def aclose(self) -> None:
        self._raw.close()
        self._slots = None
