"""A lean JSON-over-HTTP transport for the inference backends (aiohttp + orjson).

The official ``openai`` client (and httpx under it) costs several milliseconds of CPU
per request; an environment sending a request per rollout spends most of its CPU
there. This transport sends plain-``http`` calls (local inference servers) through
:class:`~atroposlib.envs.server_handling._rawhttp.RawHttpClient` (pooled keep-alive
connections on asyncio protocols, tens of microseconds per call) and ``https`` calls
through one ``aiohttp.ClientSession`` per event loop; JSON is encoded and decoded with
``orjson``, and every call has a timeout.

Errors keep the shapes the retry logic expects: transport failures surface as
``aiohttp.ClientConnectionError`` / ``asyncio.TimeoutError`` (both "unavailable" for
:func:`~atroposlib.envs.server_handling.errors.is_transport_error`), and HTTP error
answers raise :class:`HttpStatus` carrying the status, headers and body so a backend
can turn them into the exception type its callers know. Redirects are not followed: a
3xx answer raises :class:`HttpStatus` too (a POST to an inference server that moved is a
configuration error, and following it would take requests to a host nobody allowed).
Answers are bounded by ``max_answer_bytes`` (:class:`~._rawhttp.AnswerTooLarge` above it).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from atroposlib.envs.server_handling._rawhttp import (
    DEFAULT_MAX_ANSWER_BYTES,
    AnswerTooLarge,
    PeerCheck,
    PeerRefused,
    RawHttpClient,
)

try:
    import orjson

    def _dumps(body: Any) -> bytes:
        return orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS)

    _loads = orjson.loads
except ImportError:  # orjson is an optional speed-up
    import json

    def _dumps(body: Any) -> bytes:
        return json.dumps(body, separators=(",", ":")).encode()

    _loads = json.loads

logger = logging.getLogger(__name__)

_JSON_HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}


class HttpStatus(Exception):
    """An HTTP answer with status >= 400 or a redirect (``body`` is the raw response body)."""

    def __init__(self, method: str, url: str, status: int, headers: dict[str, str], body: bytes):
        self.method = method
        self.url = url
        self.status = status
        self.headers = headers
        self.body = body
        super().__init__(f"{method} {url} answered HTTP {status}: {body[:500]!r}")

    def to_httpx(self) -> Exception:
        """The equivalent ``httpx.HTTPStatusError`` (what the httpx-based code raised)."""
        import httpx

        request = httpx.Request(self.method, self.url)
        response = httpx.Response(
            self.status, headers=self.headers, content=self.body, request=request
        )
        return httpx.HTTPStatusError(str(self), request=request, response=response)


class JsonTransport:
    """Owns one ``aiohttp.ClientSession`` per event loop, created on first use.

    ``headers`` are sent with every request (e.g. ``Authorization: Bearer ...``);
    ``timeout`` bounds each call (connect, send, wait and read together). The attributes
    ``max_answer_bytes`` (largest answer body read) and ``peer_check`` (``check(host,
    address)``: whether an address a host name resolves to may be connected to) can be
    set before the first request, e.g. by a proxy that lets clients name upstreams.

        transport = JsonTransport({"Authorization": "Bearer k"}, timeout=30)
        data = await transport.post_json("http://127.0.0.1:8000/generate", {"prompt": ...})
        await transport.close()
    """

    def __init__(self, headers: dict[str, str] | None = None, timeout: float = 1200.0):
        self.headers = {**_JSON_HEADERS, **(headers or {})}
        self.timeout = float(timeout)
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._raw: RawHttpClient | None = None
        self._targets: dict[str, tuple[str, int, str] | None] = {}
        self.max_answer_bytes = DEFAULT_MAX_ANSWER_BYTES
        self.peer_check: PeerCheck | None = None

    def _plain_target(self, url: str) -> tuple[str, int, str] | None:
        """``(host, port, path?query)`` for a plain-``http`` URL, None for anything else.

        ``host`` is a name or an address (an IPv6 literal without its brackets, as sockets
        take it); an explicit port is kept as given, 0 included (it fails to connect rather
        than silently reaching port 80).
        """
        target = self._targets.get(url, False)
        if target is False:
            parts = urlsplit(url)
            if parts.scheme == "http" and parts.hostname:
                path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
                port = parts.port
                target = (parts.hostname, 80 if port is None else port, path)
            else:
                target = None
            if len(self._targets) < 1024:
                self._targets[url] = target
        return target  # type: ignore[return-value]

    def raw_client(self) -> RawHttpClient:
        """The keep-alive client of the running loop (recreated when the loop changed)."""
        loop = asyncio.get_running_loop()
        if self._raw is None or self._raw.loop is not loop:
            self._raw = RawHttpClient(self.max_answer_bytes, self.peer_check)
        return self._raw

    def session(self) -> aiohttp.ClientSession:
        """The shared session of the running loop (recreated when the loop changed)."""
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop or self._session.closed:
            resolver = _CheckedResolver(self.peer_check) if self.peer_check else None
            connector = aiohttp.TCPConnector(
                limit=0, keepalive_timeout=60, enable_cleanup_closed=False, resolver=resolver
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                headers=self.headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout, connect=min(10.0, self.timeout)),
                skip_auto_headers=("User-Agent",),
                auto_decompress=True,
            )
            self._loop = loop
        return self._session

    async def post_json(
        self,
        url: str,
        body: Any,
        timeout: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """POST ``body`` as JSON; the decoded JSON answer, or :class:`HttpStatus` for >= 400.

        Raises ``TypeError`` when ``body`` cannot be encoded (before anything is sent).
        """
        data, _ = await self.post_json_with_headers(url, body, timeout, headers)
        return data

    async def post_json_with_headers(
        self,
        url: str,
        body: Any,
        timeout: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[Any, dict[str, str]]:
        """As :meth:`post_json`, plus the answer's headers (names lower-cased), for backends
        that read metadata such as the policy version from them."""
        payload = _dumps(body)
        target = self._plain_target(url)
        if target is not None:
            host, port, path = target
            send_headers = {**self.headers, **headers} if headers else self.headers
            status, resp_headers, raw = await self.raw_client().request(
                "POST",
                host,
                port,
                path,
                send_headers,
                payload,
                self.timeout if timeout is None else timeout,
            )
            if status >= 300:
                raise HttpStatus("POST", url, status, resp_headers, raw)
            return _loads(raw), resp_headers
        kwargs: dict[str, Any] = {"data": payload, "allow_redirects": False}
        if headers:
            kwargs["headers"] = headers
        if timeout is not None:
            kwargs["timeout"] = aiohttp.ClientTimeout(total=timeout, connect=min(10.0, timeout))
        async with self.session().post(url, **kwargs) as response:
            raw = await self._read_bounded(response)
            resp_headers = {k.lower(): v for k, v in response.headers.items()}
            if response.status >= 300:
                raise HttpStatus("POST", url, response.status, resp_headers, raw)
        return _loads(raw), resp_headers

    async def _read_bounded(self, response: aiohttp.ClientResponse) -> bytes:
        """The body of ``response``, refused once it passes ``max_answer_bytes``."""
        limit = self.max_answer_bytes
        declared = response.content_length
        if declared is not None and declared > limit:
            raise AnswerTooLarge(
                f"the server's answer declares {declared} bytes, more than {limit}"
            )
        out = bytearray()
        async for chunk in response.content.iter_chunked(1 << 16):
            if len(out) + len(chunk) > limit:
                raise AnswerTooLarge(f"the server's answer exceeds the limit of {limit} bytes")
            out += chunk
        return bytes(out)

    async def get_status(self, url: str, timeout: float | None = None) -> int:
        """GET ``url`` and return the status code (the body is read and dropped)."""
        t = self.timeout if timeout is None else timeout
        target = self._plain_target(url)
        if target is not None:
            host, port, path = target
            status, _, _ = await self.raw_client().request(
                "GET", host, port, path, self.headers, b"", t
            )
            return status
        client_timeout = aiohttp.ClientTimeout(total=t, connect=min(10.0, t))
        async with self.session().get(
            url, timeout=client_timeout, allow_redirects=False
        ) as response:
            await self._read_bounded(response)
            return response.status

    async def close(self) -> None:
        """Close the session if the running loop owns it (a session of a dead loop is dropped)."""
        if self._raw is not None:
            self._raw.close()
            self._raw = None
        session, self._session = self._session, None
        if session is None or session.closed:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            await session.close()
        self._loop = None


class _CheckedResolver(aiohttp.abc.AbstractResolver):
    """aiohttp's resolver keeping only the addresses ``peer_check`` allows (so the check
    holds for the address connected to, whatever the name resolved to earlier)."""

    def __init__(self, peer_check: PeerCheck):
        self._inner = aiohttp.ThreadedResolver()
        self._check = peer_check

    async def resolve(self, host: str, port: int = 0, family: Any = 0) -> list[Any]:
        results = await self._inner.resolve(host, port, family)
        allowed = [r for r in results if self._check(host, str(r["host"]))]
        if not allowed:
            found = ", ".join(sorted({str(r["host"]) for r in results}))
            raise PeerRefused(f"{host} resolves to {found}: not an allowed upstream")
        return allowed

    async def close(self) -> None:
        await self._inner.close()
