"""``httpx``'s interface over our ``aiohttp`` session: the transport of an environment's
rollout-API client.

The environment's rollout-API client keeps ``httpx``'s interface (``Response``,
``raise_for_status``, its exception types, ``MockTransport`` in unit tests), and its calls
go over the same ``aiohttp`` stack as every inference call
(:func:`~atroposlib.http.client_session.make_session`): ``httpx``'s own pool spends
milliseconds of CPU per call once dozens of calls are in flight, ``aiohttp`` a fraction
of one. :class:`AiohttpTransport` is an ``httpx.AsyncBaseTransport``:

* proxies and certificates as the session has them (``HTTP(S)_PROXY``, ``NO_PROXY``,
  ``SSL_CERT_FILE``);
* at most ``max_connections`` connections open (a request beyond them waits for one); the
  ``connect`` timeout bounds opening a connection, the largest of the ``read``, ``write``
  and ``pool`` timeouts the whole call (waiting for a connection included);
* answers read within ``max_answer_bytes``, their ``gzip``/``deflate`` coding undone within
  it too (:func:`~atroposlib.http.client_session.read_body`);
* failures as ``httpx`` exceptions, mapped here and nowhere else: no connection (refused,
  unknown host, TLS, the proxy refused) → ``httpx.ConnectError``, none in time →
  ``httpx.ConnectTimeout``; the connection lost during the call → ``httpx.ReadError``; no
  answer in time → ``httpx.ReadTimeout``; an answer that is not valid HTTP or exceeds
  ``max_answer_bytes`` → ``httpx.RemoteProtocolError``;
* what ``h11`` (``httpx``'s own transport) refuses to send: a method or header name that is
  not a token, a header value with CR, LF or NUL → ``httpx.LocalProtocolError``, nothing sent.

Example::

    async with httpx.AsyncClient(transport=AiohttpTransport()) as client:
        response = await client.get("http://127.0.0.1:8000/status")
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import aiohttp
import httpx
import yarl

from atroposlib.http.client_session import (
    DEFAULT_MAX_ANSWER_BYTES,
    LoopSession,
    ProtocolError,
    answer_error,
    describe,
    make_session,
    read_body,
)

__all__ = ["AiohttpTransport"]

# A caller's data must not write header lines (or a request) of its own.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_BAD_VALUE = re.compile(r"[\r\n\x00]")
_SET_HERE = frozenset({"accept-encoding", "content-length", "transfer-encoding"})
_DROPPED_HEADERS = frozenset({"content-encoding", "content-length", "transfer-encoding"})


def _seconds(value: Any) -> float | None:
    return None if value is None else float(value)


def _httpx_error(exc: BaseException, request: httpx.Request) -> httpx.TransportError | None:
    """``exc`` (a failure of the ``aiohttp`` call) as the ``httpx`` error it stands for."""
    if isinstance(exc, ProtocolError):
        return httpx.RemoteProtocolError(str(exc), request=request)
    if isinstance(exc, aiohttp.ClientResponseError) and not isinstance(
        exc, aiohttp.ClientHttpProxyError
    ):
        return httpx.RemoteProtocolError(str(answer_error(exc)), request=request)
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(describe(exc), request=request)
    if isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ClientHttpProxyError)):
        return httpx.ConnectError(describe(exc), request=request)
    if isinstance(exc, asyncio.TimeoutError):
        return httpx.ReadTimeout(str(exc) or "no answer in time", request=request)
    if isinstance(exc, (aiohttp.ClientError, OSError)):
        return httpx.ReadError(describe(exc), request=request)
    return None


class AiohttpTransport(httpx.AsyncBaseTransport):
    """Sends ``httpx`` requests over an ``aiohttp`` session (one per event loop, made on
    first use; like ``httpx``'s pool it must not be shared across loops)."""

    def __init__(
        self, max_connections: int = 8, max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self.max_connections = int(max_connections)
        self.max_answer_bytes = int(max_answer_bytes)
        self._sessions = LoopSession(lambda: make_session(limit=self.max_connections))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme not in ("http", "https"):
            raise httpx.UnsupportedProtocol(
                f"unsupported URL scheme {url.scheme!r}: expected http or https", request=request
            )
        if not _TOKEN.fullmatch(request.method):
            raise httpx.LocalProtocolError(f"illegal method {request.method!r}", request=request)
        for name, value in request.headers.items():
            if not _TOKEN.fullmatch(name) or _BAD_VALUE.search(value):
                raise httpx.LocalProtocolError(
                    f"illegal header {name!r}: {value!r}", request=request
                )
        timeouts = request.extensions.get("timeout", {})
        spans = [_seconds(timeouts.get(k)) for k in ("read", "write", "pool")]
        known = [s for s in spans if s is not None]
        timeout = aiohttp.ClientTimeout(
            total=max(known) if len(known) == len(spans) else None,
            sock_connect=_seconds(timeouts.get("connect")),
        )
        # httpx offers the codings it decodes (br, zstd); the session offers what it decodes
        # within the bound, and sets the length of what it sends.
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _SET_HERE]
        try:
            session = self._sessions.get()
            target = str(url)
            async with session.request(
                request.method,
                yarl.URL(target, encoded=True),  # httpx has encoded it: sent as it is
                data=await request.aread() or None,
                headers=headers,
                timeout=timeout,
                allow_redirects=False,
                proxy=self._sessions.proxies.for_url(target),
            ) as answer:
                body = await read_body(answer, self.max_answer_bytes)
                status = answer.status
                # The body is decoded here: its headers describe it so (a HEAD's length
                # is the GET's, kept as sent).
                dropped = _DROPPED_HEADERS if request.method != "HEAD" else ()
                answer_headers = [
                    (k, v) for k, v in answer.headers.items() if k.lower() not in dropped
                ]
        except Exception as e:  # noqa: BLE001 - sorted by _httpx_error; others re-raised
            mapped = _httpx_error(e, request)
            if mapped is None:
                raise
            raise mapped from e
        return httpx.Response(
            status,
            headers=answer_headers,
            content=body,
            request=request,
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def aclose(self) -> None:
        await self._sessions.close()
