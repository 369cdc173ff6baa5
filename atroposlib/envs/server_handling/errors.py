"""Errors of the inference server layer, in one place: what the client raises, and how a
failure is classified (server unavailable, the caller's fault, worth retrying).

Every call to an inference server goes through :class:`~._transport.JsonTransport`, whose
failures are mapped here, once, by :func:`mapped_errors`:

- the server could not be reached → :class:`ServerConnectionError` (an
  ``openai.APIConnectionError`` and a ``ConnectionError``); its TLS certificate did not
  verify → :class:`ServerTLSError` (one of those, whose message says so and names
  ``SSL_CERT_FILE``);
- the connection broke after the request was sent (reset, closed mid-answer) →
  :class:`ServerReadError` (a :class:`ServerConnectionError`, so what caught that still does);
- no connection or no answer within the timeout → :class:`ServerTimeoutError` (an
  ``openai.APITimeoutError`` and an ``asyncio.TimeoutError``);
- an HTTP error answer or a redirect → the ``openai.APIStatusError`` subclass the ``openai``
  client raises for that status (``openai.BadRequestError`` for 400, ...), with the answer's
  headers and body on ``.response``.

``aiohttp``'s errors are mapped by one table, :data:`CLIENT_ERRORS`; an answer that is not
what HTTP allows (:class:`~atroposlib.http.client_session.ProtocolError`: too large,
malformed) passes through unchanged: the server answered, wrongly.
So code written against the ``openai`` client catches what it caught before, whichever
backend answered. :func:`is_transport_error`, :func:`status_code` and :func:`is_transient`
also recognise the errors of other HTTP clients (``httpx``, ``aiohttp``) that user code may
raise from inside an environment: the classification of a failure is answered here only.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import aiohttp
import httpx
import openai
import orjson

from atroposlib.http.client_session import ProtocolError, answer_error, describe

__all__ = [
    "CLIENT_ERRORS",
    "NoHealthyServerError",
    "ServerConnectionError",
    "ServerReadError",
    "ServerTLSError",
    "ServerTimeoutError",
    "ServerUnavailableError",
    "causes",
    "is_client_error",
    "is_retryable",
    "is_transient",
    "is_transport_error",
    "mapped_errors",
    "status_code",
    "status_error",
]


class ServerUnavailableError(ConnectionError):
    """A server refused the connection or timed out; it has been marked unhealthy."""

    def __init__(self, server: str, cause: BaseException | None = None):
        self.server = server
        self.cause = cause
        detail = f": {type(cause).__name__}: {cause}" if cause is not None else ""
        super().__init__(f"inference server {server} is unavailable{detail}")


class NoHealthyServerError(TimeoutError):
    """No server could take the request before the deadline."""

    def __init__(
        self, servers: list[str], waited_s: float, last_error: BaseException | None = None
    ):
        self.servers = servers
        self.waited_s = waited_s
        self.last_error = last_error
        tail = f"; last error: {type(last_error).__name__}: {last_error}" if last_error else ""
        super().__init__(
            f"no healthy inference server after waiting {waited_s:.1f}s "
            f"(servers: {'; '.join(servers) or 'none'}){tail}"
        )


class ServerConnectionError(openai.APIConnectionError, ConnectionError):
    """The inference server could not be reached (refused, reset, name not resolved, TLS
    failure, an address the client may not connect to), or the connection broke before its
    answer was complete. The low-level error is ``__cause__``."""

    def __init__(self, method: str, url: str, cause: BaseException):
        detail = str(cause) or type(cause).__name__
        super().__init__(
            message=f"{method} {url}: cannot reach the inference server: {detail}",
            request=httpx.Request(method, url),
        )


class ServerTLSError(ServerConnectionError):
    """The inference server's TLS certificate did not verify against the trust store
    (the system's, or ``SSL_CERT_FILE``'s): a configuration error, not an outage."""


class ServerReadError(ServerConnectionError):
    """The connection to the inference server broke after the request was sent (reset, or
    closed before the answer was complete): the server may have seen the request."""

    def __init__(self, method: str, url: str, cause: BaseException):
        super().__init__(method, url, cause)
        detail = str(cause) or type(cause).__name__
        self.message = (
            f"{method} {url}: the connection to the inference server broke before its "
            f"answer was complete: {detail}"
        )
        self.args = (self.message,)


class ServerTimeoutError(openai.APITimeoutError, asyncio.TimeoutError):
    """The inference server did not answer within the timeout."""

    def __init__(self, method: str, url: str, cause: BaseException | None = None):
        super().__init__(httpx.Request(method, url))
        detail = f": {cause}" if cause is not None and str(cause) else ""
        self.message = f"{method} {url}: the inference server did not answer in time{detail}"
        self.args = (self.message,)


_STATUS_ERRORS: dict[int, type[openai.APIStatusError]] = {
    400: openai.BadRequestError,
    401: openai.AuthenticationError,
    403: openai.PermissionDeniedError,
    404: openai.NotFoundError,
    409: openai.ConflictError,
    422: openai.UnprocessableEntityError,
    429: openai.RateLimitError,
}


def status_error(
    method: str, url: str, status: int, headers: Mapping[str, str], body: bytes
) -> openai.APIStatusError:
    """The ``openai`` exception for an HTTP error answer (or a redirect, which is not
    followed), as the ``openai`` client builds it: its message is ``Error code: N`` plus the
    answer's ``error.message``; ``.body`` is the decoded ``error`` object (or the text)."""
    text = body.decode("utf-8", "replace").strip()
    message = f"Error code: {status}"
    data: Any = text
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError:
        pass
    else:
        error = data.get("error", data) if isinstance(data, dict) else None
        detail = error.get("message") if isinstance(error, dict) else None
        if isinstance(detail, str) and detail:
            message += f" - {detail}"
        if isinstance(data, dict):
            data = data.get("error", data)
    if status >= 500:
        cls: type[openai.APIStatusError] = openai.InternalServerError
    else:
        cls = _STATUS_ERRORS.get(status, openai.APIStatusError)
    response = httpx.Response(
        status, headers=dict(headers), content=body, request=httpx.Request(method, url)
    )
    return cls(message, response=response, body=data)


CLIENT_ERRORS: tuple[tuple[type[BaseException], type[openai.APIConnectionError]], ...] = (
    (aiohttp.ClientConnectorCertificateError, ServerTLSError),
    (aiohttp.ClientConnectorError, ServerConnectionError),  # refused, DNS, TLS, proxy, peer
    (aiohttp.ClientHttpProxyError, ServerConnectionError),  # the proxy refused CONNECT
    (aiohttp.ServerTimeoutError, ServerTimeoutError),
    (asyncio.TimeoutError, ServerTimeoutError),
    (aiohttp.ServerDisconnectedError, ServerReadError),
    (aiohttp.ClientPayloadError, ServerReadError),
    (aiohttp.ClientOSError, ServerReadError),  # reset after the connection was made
    (aiohttp.ClientConnectionError, ServerConnectionError),
    (OSError, ServerConnectionError),
)
"""The error each failure of the ``aiohttp`` session becomes: the first entry whose class
the failure is an instance of (most specific first). :class:`ProtocolError` is not here: an
answer that is too large or malformed passes through, and so does ``aiohttp``'s refusal of
an answer it could not parse (as a :class:`ProtocolError`)."""


def _client_error(exc: BaseException) -> type[openai.APIConnectionError] | None:
    for cls, error in CLIENT_ERRORS:
        if isinstance(exc, cls):
            return error
    return None


class _MappedErrors:
    """The context of :func:`mapped_errors`. A class rather than a generator-based context
    manager: it wraps every request to an inference server, and the generator machinery
    cost more than the rest of the mapping."""

    __slots__ = ("method", "url")

    def __init__(self, method: str, url: str) -> None:
        self.method = method
        self.url = url

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc is None or isinstance(exc, (openai.APIError, ProtocolError)):  # already ours
            return False
        if isinstance(exc, aiohttp.ClientResponseError) and not isinstance(
            exc, aiohttp.ClientHttpProxyError
        ):
            # Raised before any answer was returned: aiohttp could not parse it.
            raise answer_error(exc) from exc
        cls = _client_error(exc)
        if cls is None:
            return False
        cause = exc if cls is ServerTimeoutError else _Described(exc)
        raise cls(self.method, self.url, cause) from exc


class _Described(Exception):
    """A low-level failure as :func:`~atroposlib.http.client_session.describe` tells it (the
    mapped error's message quotes it; the failure itself is the ``__cause__``)."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(describe(exc))


def mapped_errors(method: str, url: str) -> contextlib.AbstractContextManager[None]:
    """Turn the low-level failures of a call to ``url`` into this module's errors.

    ``aiohttp``'s errors (and any ``OSError`` or timeout) become what :data:`CLIENT_ERRORS`
    says. Errors that mean the server answered, wrongly (too large, not HTTP, not JSON),
    pass through (``aiohttp``'s refusal of an unparsable answer as a
    :class:`~atroposlib.http.client_session.ProtocolError`).
    """
    return _MappedErrors(method, url)


# ----------------------------------------------------------------------------- classification
_TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    openai.APIConnectionError,  # ours (ServerConnectionError, ServerTimeoutError) included
    httpx.TransportError,
    aiohttp.ClientConnectionError,
    asyncio.TimeoutError,
    OSError,  # ConnectionError, TimeoutError, ServerUnavailableError
)


def is_transport_error(exc: BaseException) -> bool:
    """True when ``exc`` means the server could not be reached or did not answer in time."""
    return isinstance(exc, _TRANSPORT_ERRORS)


def status_code(exc: BaseException) -> int | None:
    """The HTTP status an error answer carried (``openai``, ``httpx`` or ``aiohttp``), if any."""
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code
    if isinstance(exc, aiohttp.ClientResponseError):
        return exc.status
    return None


def is_client_error(exc: BaseException) -> bool:
    """True for HTTP 4xx answers that retrying cannot fix (408 and 429 are retryable)."""
    status = status_code(exc)
    return status is not None and 400 <= status < 500 and status not in (408, 429)


def is_retryable(exc: BaseException) -> bool:
    """Whether another attempt of the same request could succeed: not for the caller's
    errors (4xx but 408/429), not for what the backend cannot do, not when the server was
    already given up on (:class:`ServerUnavailableError`, the caller tries another)."""
    return (
        isinstance(exc, Exception)
        and not isinstance(exc, (ServerUnavailableError, NotImplementedError))
        and not is_client_error(exc)
    )


def causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then what it wraps: a ``tenacity.RetryError``'s last attempt, the cause or
    the context, each once."""
    seen = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        last_attempt = getattr(current, "last_attempt", None)  # tenacity.RetryError
        inner = last_attempt.exception() if last_attempt is not None else None
        current = inner or current.__cause__ or current.__context__


def is_transient(exc: BaseException) -> bool:
    """True for errors that waiting can fix: connection, timeout, HTTP 5xx, 408 and 429,
    looked for in ``exc`` and the errors it wraps."""
    for cause in causes(exc):
        code = status_code(cause)
        if code is not None:
            return code >= 500 or code in (408, 429)
        if is_transport_error(cause):
            return True
    return False
