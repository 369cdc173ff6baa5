"""Exceptions of the inference server layer and the classification of transport failures."""

from __future__ import annotations

import asyncio

import httpx
import openai


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


_TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    openai.APIConnectionError,  # includes APITimeoutError
    httpx.TransportError,  # connect/read/write errors and timeouts
    asyncio.TimeoutError,
    ConnectionError,
    OSError,
)


def is_transport_error(exc: BaseException) -> bool:
    """True when ``exc`` means the server could not be reached or did not answer in time."""
    if isinstance(exc, ServerUnavailableError):
        return True
    try:
        import aiohttp

        if isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.ServerTimeoutError)):
            return True
    except ImportError:  # aiohttp is optional for this check
        pass
    return isinstance(exc, _TRANSPORT_ERRORS)


def is_client_error(exc: BaseException) -> bool:
    """True for HTTP 4xx answers that retrying cannot fix (408 and 429 are retryable)."""
    status = None
    if isinstance(exc, openai.APIStatusError):
        status = exc.status_code
    elif isinstance(exc, httpx.HTTPStatusError):
        status = exc.response.status_code
    return status is not None and 400 <= status < 500 and status not in (408, 429)
