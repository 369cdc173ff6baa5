"""The proxy's upstream side: which inference servers it may reach (:class:`UpstreamPolicy`),
how it tells the client's faults from the inference server's, and how it turns the inference
server's into answers (see README.md, "Proxy status classes").

A session's ``ManagedServer`` calls its backend through an :class:`UpstreamTap`, which
marks the request as having reached the inference server: a failure before that point is
the client's input (400), from then on the inference server's (502, or its own HTTP class).
"""

from __future__ import annotations

import asyncio
import contextvars
import ipaddress
import json
import logging
import math
import socket
from typing import Any, Callable, Iterable
from urllib.parse import urlsplit

import orjson
from fastapi.responses import Response

from atroposlib.envs.server_handling.errors import NoHealthyServerError, status_code
from atroposlib.http.openai_protocol import OpenAIError
from atroposlib.http.security import is_loopback_host

logger = logging.getLogger(__name__)


def _upstream_status(exc: BaseException) -> tuple[int, str, str | None] | None:
    """The status, message and ``Location`` of an inference server's HTTP error answer (or
    redirect), if ``exc`` is one."""
    status = status_code(exc)
    if status is None:
        return None
    response = getattr(exc, "response", None)  # openai's and httpx's errors carry the answer
    try:
        text = response.text if response is not None else str(exc)
    except Exception:  # noqa: BLE001 - a streamed body cannot be read here; the summary will do
        text = str(exc)
    headers = getattr(response, "headers", None) or getattr(exc, "headers", None) or {}
    return status, text[:1000], headers.get("location")


def upstream_http_error(status: int, text: str, location: str | None) -> OpenAIError:
    """The proxy's answer to an inference server's HTTP error or redirect.

    A 4xx keeps its status (the request was refused) unless it says the proxy itself is
    misconfigured: 401/403/407 (the proxy's credentials) and 404 (its URL or model name)
    are 502s, so an OpenAI client never takes them for the proxy's own auth or routing
    errors. Every one is typed ``upstream_error``.
    """
    if 300 <= status < 400:
        where = f" to {location[:200]!r}" if location else ""
        return OpenAIError(
            f"inference server answered a redirect (HTTP {status}{where}); redirects are not "
            "followed: configure the server's final URL",
            status=502,
            type="upstream_error",
        )
    if status in (401, 403, 407):
        return OpenAIError(
            f"inference server refused the proxy's credentials (HTTP {status}): {text}; check "
            "the api_key of the proxy's server config",
            status=502,
            type="upstream_error",
        )
    if status == 404:
        return OpenAIError(
            f"inference server answered 404 (wrong base_url or model_name in the proxy's "
            f"server config?): {text}",
            status=502,
            type="upstream_error",
        )
    if 400 <= status < 500:
        return OpenAIError(
            f"inference server refused the request: {text}", status=status, type="upstream_error"
        )
    return OpenAIError(
        f"inference server error (HTTP {status}): {text}", status=502, type="upstream_error"
    )


def _client_error_types() -> tuple[type[BaseException], ...]:
    import jinja2

    # RecursionError: a message nested too deeply for the template (the client's input).
    return (ValueError, KeyError, TypeError, RecursionError, jinja2.TemplateError)


UPSTREAM_REACHED: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar(
    "proxy_upstream_reached", default=None
)
"""Per request: set once the session's backend has been called, so a failure after that
point is the inference server's (its answer could not be used), not the client's."""

UPSTREAM_USAGE: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "proxy_upstream_usage", default=None
)
"""Per request that wants usage (a stream's ``include_usage``): ``[prompt_tokens,
completion_tokens]`` as the inference server was asked and answered."""


class UpstreamTap:
    """Stands in for a backend inside a session's ``ManagedServer`` and marks the request
    as having reached the inference server; everything else is the backend's own."""

    def __init__(self, server: Any):
        object.__setattr__(self, "_server", server)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._server, name, value)

    @staticmethod
    def _mark() -> None:
        reached = UPSTREAM_REACHED.get()
        if reached is not None:
            reached[0] = True

    async def tokens_and_logprobs_completion(self, **kwargs: Any) -> Any:
        """The backend's call, marked as reaching the inference server."""
        self._mark()
        result = await self._server.tokens_and_logprobs_completion(**kwargs)
        usage = UPSTREAM_USAGE.get()
        if usage is not None:
            # Prompt tokens count once per request (as OpenAI counts them for n > 1).
            usage[0] = len(kwargs.get("input_ids") or ())
            usage[1] += sum(len(out) for out in result[1])
        return result


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities replaced by None (JSON has no such numbers)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def strict_tool_arguments(payload: dict[str, Any]) -> None:
    """Make every tool call's ``arguments`` strict JSON, in place.

    Python's parser accepts ``NaN`` and ``Infinity`` where the model wrote them; passed on,
    an OpenAI client's ``json.loads`` may accept them but other parsers refuse the call.
    They become ``null``, as ``JSON.stringify`` writes them.
    """
    for choice in payload.get("choices") or ():
        for call in (choice.get("message") or {}).get("tool_calls") or ():
            function = call.get("function") or {}
            arguments = function.get("arguments")
            if not isinstance(arguments, str) or not any(
                word in arguments for word in ("NaN", "Infinity")
            ):
                continue
            try:
                parsed = json.loads(arguments)
                json.dumps(parsed, allow_nan=False)
                continue  # the words were inside strings
            except (ValueError, RecursionError):
                pass
            try:
                function["arguments"] = json.dumps(_finite(json.loads(arguments)))
            except (ValueError, RecursionError):
                continue  # not JSON at all: the client sees what the parser gave
            logger.warning(
                "tool call %r: non-finite numbers in arguments sent as null", function.get("name")
            )


def upstream_json(value: Any) -> bytes:
    """``value`` (built from an inference server's output) as JSON bytes; output that cannot
    be encoded (a lone surrogate the model spelled out in a tool call) is a 502, not a bare
    500."""
    try:
        return orjson.dumps(value)
    except (TypeError, orjson.JSONEncodeError) as e:
        raise OpenAIError(
            f"the inference server's output cannot be sent as JSON: {e}",
            status=502,
            type="upstream_error",
        ) from e


def json_answer(payload: dict[str, Any]) -> Response:
    """``payload`` as a JSON response (see :func:`upstream_json`)."""
    return Response(upstream_json(payload), media_type="application/json")


def proxy_error_for(exc: BaseException, reached_upstream: bool) -> OpenAIError:
    """The proxy's answer to ``exc``, raised by a session's ``ManagedServer`` call;
    ``reached_upstream`` says whether the inference server had been called."""
    if isinstance(exc, NotImplementedError):
        return OpenAIError(str(exc), status=501, type="not_implemented")
    if isinstance(exc, NoHealthyServerError):
        return OpenAIError(str(exc), status=503, type="server_error")
    upstream = _upstream_status(exc)
    if upstream is not None and upstream[0] >= 300:
        return upstream_http_error(*upstream)
    if isinstance(exc, asyncio.TimeoutError):
        return OpenAIError("inference server timed out", status=504, type="upstream_error")
    if not reached_upstream and isinstance(exc, _client_error_types()):
        return OpenAIError(f"{type(exc).__name__}: {exc}", status=400)
    logger.warning("inference server fault: %s: %s", type(exc).__name__, exc)
    return OpenAIError(
        f"inference server error: its answer could not be used: {type(exc).__name__}: {exc}",
        status=502,
        type="upstream_error",
    )


AddressInfo = Callable[[str, int], Iterable[Any]]


def _resolve(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def is_loopback_address(address: str) -> bool:
    """Whether ``address`` (an IP literal, IPv6 with or without a zone) is loopback.

    An IPv4-mapped IPv6 address counts as the IPv4 address it maps."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


class UpstreamPolicy:
    """Which inference-server URLs ``POST /setup`` may point the proxy at.

    Entries are host names or addresses (``gpu-node-3``, ``10.0.0.5``), optionally with a port
    (``gpu-node-3:9001``) or a leading ``*.`` for subdomains (``*.cluster.local``); ``*``
    allows any host. Loopback hosts are always allowed — a host allowed only for being
    loopback must resolve to loopback addresses only (:meth:`setup_problem`), and the
    proxy connects to it only at loopback addresses (:meth:`peer_allowed`), so a name that
    later resolves elsewhere (DNS rebinding) reaches nothing. Only ``http``/``https`` pass.
    """

    def __init__(
        self, allowed: Iterable[str] = (), resolve: Callable[[str, int], list[str]] = _resolve
    ):
        self.entries = [a.strip().lower() for a in allowed if a and a.strip()]
        self.resolve = resolve

    def _listed(self, host: str, port: int | None) -> bool:
        for entry in self.entries:
            if entry == "*":
                return True
            name, _, entry_port = (
                entry.rpartition(":") if entry.count(":") == 1 else (entry, "", "")
            )
            if entry_port and port is not None and str(port) != entry_port:
                continue
            if name == host or (name.startswith("*.") and host.endswith(name[1:])):
                return True
        return False

    def allows(self, url: str | None) -> bool:
        """Whether ``url`` is an allowed upstream by its form (names are not resolved)."""
        try:
            parts = urlsplit(url or "")
            host = (parts.hostname or "").lower()
            port = parts.port
        except ValueError:
            return False
        if parts.scheme not in ("http", "https") or not host:
            return False
        if is_loopback_host(host):
            return True
        return self._listed(host, port if port is not None else -1)

    def setup_problem(self, url: str | None) -> str | None:
        """Why ``url`` may not be set up, or None. Blocking (resolves names): run it in a
        thread. A host that is not listed must be a loopback address, or a name every
        address of which is loopback."""
        if not self.allows(url):
            return "only loopback servers and the hosts given with --allow-upstream may be set up"
        parts = urlsplit(url or "")
        host = (parts.hostname or "").lower()
        port = parts.port
        if self._listed(host, port if port is not None else -1):
            return None
        try:
            ipaddress.ip_address(host)
            addresses = [host]  # a literal: nothing to resolve
        except ValueError:
            addresses = []
        try:
            addresses = addresses or self.resolve(host, port or 80)
        except (OSError, UnicodeError) as e:
            return f"host {host!r} does not resolve ({e})"
        foreign = [a for a in addresses if not is_loopback_address(a)]
        if not addresses or foreign:
            return (
                f"host {host!r} resolves to {', '.join(foreign) or 'nothing'}, not loopback; "
                "name non-loopback hosts with --allow-upstream"
            )
        return None

    def peer_allowed(self, host: str, address: str) -> bool:
        """Whether the proxy may connect to ``address``, resolved from ``host``: a listed
        host at any address, any other host only at a loopback address."""
        return self._listed(host.lower(), None) or is_loopback_address(address)
