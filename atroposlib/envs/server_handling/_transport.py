"""The one HTTP client of the inference server layer: JSON over keep-alive HTTP/1.1.

Every call to an inference server (OpenAI-protocol completions, native ``/generate``,
health probes) goes through :class:`JsonTransport`: ``http`` and ``https`` alike over
:class:`~atroposlib.http.client.RawHttpClient` (pooled keep-alive
connections on asyncio protocols, tens of microseconds of CPU per call, where a general
client such as the ``openai`` SDK over httpx spends milliseconds), JSON encoded and decoded
with ``orjson``, every call bounded by a timeout.

Failures are mapped in one place, :func:`~atroposlib.envs.server_handling.errors.mapped_errors`:
the server could not be reached → ``ServerConnectionError``, the connection broke
mid-answer → ``ServerReadError``, no answer in time → ``ServerTimeoutError``, an HTTP error answer → the ``openai.APIStatusError`` subclass for
its status. Redirects are not followed: a 3xx answer raises ``openai.APIStatusError`` too (a
POST to an inference server that moved is a configuration error, and following it would take
requests to a host nobody allowed). Answers are bounded by ``max_answer_bytes``
(:class:`~atroposlib.http.client.AnswerTooLarge` above it).
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlsplit

import orjson
from pydantic import BaseModel

from atroposlib.envs.server_handling.errors import mapped_errors, status_error
from atroposlib.envs.server_handling.session_affinity import CURRENT_SESSION
from atroposlib.http.client import DEFAULT_MAX_ANSWER_BYTES, LoopClient, PeerCheck, RawHttpClient
from atroposlib.http.headers import SESSION_ID_HEADER

logger = logging.getLogger(__name__)

_JSON_HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}
_MAX_CACHED_URLS = 1024

Target = tuple[str, int, str, bool]
"""``(host, port, path?query, tls)`` of a URL."""


def _json_default(value: Any) -> Any:
    # What the openai client accepts in a request besides plain JSON: pydantic objects (a
    # ChatCompletionMessage passed back in ``messages``) and sets.
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_unset=True)
    if isinstance(value, (set, frozenset)):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def encode_json(body: Any) -> bytes:
    """``body`` as compact JSON; ``TypeError`` for what cannot be encoded."""
    return orjson.dumps(
        body, default=_json_default, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY
    )


class JsonTransport:
    """Owns the keep-alive connections of one backend (per event loop, created on first use).

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
        self._clients = LoopClient(lambda: RawHttpClient(self.max_answer_bytes, self.peer_check))
        self._targets: dict[str, Target] = {}
        self.max_answer_bytes = DEFAULT_MAX_ANSWER_BYTES
        self.peer_check: PeerCheck | None = None

    def _target(self, url: str) -> Target:
        """``(host, port, path?query, tls)`` of an ``http``/``https`` URL; ``ValueError``
        for anything else.

        ``host`` is a name or an address (an IPv6 literal without its brackets, as sockets
        take it); an explicit port is kept as given, 0 included (it fails to connect rather
        than silently reaching the scheme's default port).
        """
        target = self._targets.get(url)
        if target is None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"inference server URL {url!r}: expected http:// or https://")
            tls = parts.scheme == "https"
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            port = parts.port
            target = (parts.hostname, (443 if tls else 80) if port is None else port, path, tls)
            if len(self._targets) < _MAX_CACHED_URLS:
                self._targets[url] = target
        return target

    def raw_client(self) -> RawHttpClient:
        """The keep-alive client of the running loop (recreated when the loop changed)."""
        return self._clients.get()

    async def request(
        self,
        method: str,
        url: str,
        payload: bytes = b"",
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
        raise_status: bool = True,
    ) -> tuple[int, dict[str, str], bytes]:
        """Send one request; ``(status, lower-cased headers, body)`` of the answer.

        An answer with status >= 300 raises the ``openai`` status error for it unless
        ``raise_status`` is False; failures to reach the server raise
        ``ServerConnectionError`` / ``ServerTimeoutError``.
        """
        host, port, path, tls = self._target(url)
        send_headers = {**self.headers, **headers} if headers else self.headers
        session = CURRENT_SESSION.get()
        if session is not None:
            send_headers = {**send_headers, SESSION_ID_HEADER: session}
        with mapped_errors(method, url):
            status, resp_headers, raw = await self.raw_client().request(
                method,
                host,
                port,
                path,
                send_headers,
                payload,
                self.timeout if timeout is None else timeout,
                tls,
            )
        if raise_status and status >= 300:
            raise status_error(method, url, status, resp_headers, raw)
        return status, resp_headers, raw

    async def post_json(
        self,
        url: str,
        body: Any,
        timeout: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """POST ``body`` as JSON; the decoded JSON answer.

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
        _, resp_headers, raw = await self.request("POST", url, encode_json(body), headers, timeout)
        return orjson.loads(raw), resp_headers

    async def get_status(self, url: str, timeout: float | None = None) -> int:
        """GET ``url`` and return the status code (the body is read and dropped)."""
        status, _, _ = await self.request("GET", url, timeout=timeout, raise_status=False)
        return status

    async def close(self) -> None:
        """Close the idle connections (those of a closed loop are dropped with it)."""
        self._clients.close()
