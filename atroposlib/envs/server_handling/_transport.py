"""The one HTTP client of the inference server layer: JSON over ``aiohttp``.

Every call to an inference server (OpenAI-protocol completions, native ``/generate``,
health probes) goes through :class:`JsonTransport`: ``http`` and ``https`` alike over an
``aiohttp`` session (:func:`~atroposlib.http.client_session.make_session`: keep-alive
connections, the environment's proxy variables and ``SSL_CERT_FILE`` honoured, answers
read within ``max_answer_bytes``), JSON encoded and decoded with ``orjson``, every call
bounded by a timeout.

Failures are mapped in one place, :func:`~atroposlib.envs.server_handling.errors.mapped_errors`:
the server could not be reached → ``ServerConnectionError`` (a TLS certificate that does not
verify: ``ServerTLSError``, which says so), the connection broke mid-answer →
``ServerReadError``, no answer in time → ``ServerTimeoutError``, an HTTP error answer → the
``openai.APIStatusError`` subclass for its status. Redirects are not followed: a 3xx answer
raises ``openai.APIStatusError`` too (a POST to an inference server that moved is a
configuration error, and following it would take requests to a host nobody allowed). Answers
are bounded by ``max_answer_bytes``
(:class:`~atroposlib.http.client_session.AnswerTooLarge` above it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import aiohttp
import orjson
from pydantic import BaseModel

from atroposlib.envs.server_handling.errors import mapped_errors, status_error
from atroposlib.envs.server_handling.session_affinity import CURRENT_SESSION
from atroposlib.http.client_session import (
    DEFAULT_MAX_ANSWER_BYTES,
    LoopSession,
    MalformedAnswer,
    PeerCheck,
    make_session,
    read_body,
)
from atroposlib.http.headers import SESSION_ID_HEADER

logger = logging.getLogger(__name__)

_JSON_HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}
_MAX_CACHED_TIMEOUTS = 64
MAX_CONNECTIONS = 4096
"""Connections one transport keeps open at most (beyond it, requests wait for one)."""


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
        self.max_answer_bytes = DEFAULT_MAX_ANSWER_BYTES
        self.peer_check: PeerCheck | None = None
        self._sessions = LoopSession(self._make_session)
        self._timeouts: dict[float, aiohttp.ClientTimeout] = {}

    def _make_session(self) -> aiohttp.ClientSession:
        # A peer-checked transport connects directly: behind a proxy, the check would see
        # the proxy's address, not the upstream's.
        self._sessions.use_proxies = self.peer_check is None
        return make_session(limit=MAX_CONNECTIONS, peer_check=self.peer_check)

    def session(self) -> aiohttp.ClientSession:
        """The ``aiohttp`` session of the running loop (recreated when the loop changed)."""
        return self._sessions.get()

    def _timeout(self, seconds: float) -> aiohttp.ClientTimeout:
        timeout = self._timeouts.get(seconds)
        if timeout is None:
            timeout = aiohttp.ClientTimeout(total=seconds)
            if len(self._timeouts) < _MAX_CACHED_TIMEOUTS:
                self._timeouts[seconds] = timeout
        return timeout

    async def request(
        self,
        method: str,
        url: str,
        payload: bytes = b"",
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
        raise_status: bool = True,
    ) -> tuple[int, Mapping[str, str], bytes]:
        """Send one request; ``(status, headers, body)`` of the answer (headers looked up
        case-insensitively).

        An answer with status >= 300 raises the ``openai`` status error for it unless
        ``raise_status`` is False; failures to reach the server raise
        ``ServerConnectionError`` / ``ServerTimeoutError``.
        """
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"inference server URL {url!r}: expected http:// or https://")
        send_headers = {**self.headers, **headers} if headers else self.headers
        sid = CURRENT_SESSION.get()
        if sid is not None:
            send_headers = {**send_headers, SESSION_ID_HEADER: sid}
        seconds = self.timeout if timeout is None else timeout
        with mapped_errors(method, url):
            client = self._sessions.get()
            async with client.request(
                method,
                url,
                data=payload or None,
                headers=send_headers,
                timeout=self._timeout(seconds),
                allow_redirects=False,
                proxy=self._sessions.proxies.for_url(url),
            ) as response:
                status = response.status
                resp_headers = response.headers
                if status < 200:  # aiohttp skips interim answers; this one is final
                    raise MalformedAnswer(
                        f"{method} {url}: the server answered {status} {response.reason} "
                        "where an HTTP answer was expected"
                    )
                raw = await read_body(response, self.max_answer_bytes)
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
    ) -> tuple[Any, Mapping[str, str]]:
        """As :meth:`post_json`, plus the answer's headers (names lower-cased), for backends
        that read metadata such as the policy version from them."""
        _, resp_headers, raw = await self.request("POST", url, encode_json(body), headers, timeout)
        return orjson.loads(raw), resp_headers

    async def get_status(self, url: str, timeout: float | None = None) -> int:
        """GET ``url`` and return the status code (the body is read and dropped)."""
        status, _, _ = await self.request("GET", url, timeout=timeout, raise_status=False)
        return status

    async def close(self) -> None:
        """Close the connections (those of a closed loop are dropped with it)."""
        await self._sessions.close()
