"""One security model for every server we ship (docs/design.md, "Security model").

``run-api``, ``atropos-serve-model``, the OpenAI proxy and ``view-run`` listen on loopback by
default, and a page open in the user's browser can still reach loopback. Two pure-ASGI layers
keep such a page from driving a local server:

* :class:`BrowserGuardMiddleware` refuses requests that only a browser under someone else's
  control would send: a foreign ``Origin`` (403), a ``Host`` that is not a loopback name while
  the server is bound to loopback (DNS rebinding, 403), a request body that is not JSON on a JSON
  endpoint (415: ``text/plain`` and form posts are the ones a page can send without a CORS
  preflight), and a state-changing ``GET`` issued by a browser (403).
* :class:`BearerAuthMiddleware` requires ``Authorization: Bearer KEY`` everywhere but the open
  paths when a key is configured (401).

Clients that are not browsers (environments, trainers, ``curl``) send no ``Origin`` and no
``Sec-Fetch-*`` headers and a loopback ``Host``, so they are unaffected.

:func:`atroposlib.http.server.build_server` puts both in front of every server, in one order.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import orjson

from atroposlib.http.answers import ErrorShape, detail_error, send_error
from atroposlib.http.asgi import ASGIApp, Receive, Scope, Send

logger = logging.getLogger(__name__)

__all__ = [
    "BearerAuthMiddleware",
    "BrowserGuardMiddleware",
    "is_loopback_host",
    "json_value_problem",
    "load_api_key",
]

_INT64_RANGE = (-(2**63), 2**64 - 1)
"""Integers a JSON encoder in C (orjson, the HTTP clients) can write back out."""

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_BROWSER_CROSS_SITE = frozenset({b"cross-site", b"same-site"})
_GUARDED_GET_ADVICE = "it changes the server's state; call it from a client that is not a browser"
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def _strip_port(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[1:end] if end != -1 else host[1:]
    if host.count(":") == 1:
        return host.split(":", 1)[0]
    return host


@functools.lru_cache(maxsize=256)
def is_loopback_host(host: str) -> bool:
    """True for a loopback name or address, with or without a port.

    ``localhost``, ``*.localhost``, ``127.0.0.0/8`` and ``::1`` are loopback; an empty value is not.
    Verdicts are cached: the guards ask this for the ``Host`` of every request, and parsing an
    address costs microseconds.
    """
    name = _strip_port(host).rstrip(".")
    if not name:
        return False
    if name in _LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def load_api_key(
    flag_value: str | None,
    key_file: str | os.PathLike[str] | None = None,
    env_var: str = "ATROPOS_API_KEY",
    *,
    component: str = "server",
) -> str | None:
    """The API key from the command-line flag, a key file or the environment, in that order.

    A key given as a flag shows in ``ps`` to every user of the machine, so that form logs a
    warning naming the safe ones. A key file holds the key alone (surrounding white space is
    ignored); a missing or empty file raises :class:`ValueError` naming it.
    """
    if flag_value:
        logger.warning(
            "%s: the API key was given with --api-key and is visible to other users in `ps`; "
            "prefer the %s environment variable or --api-key-file PATH",
            component,
            env_var,
        )
        return flag_value
    if key_file:
        path = Path(key_file).expanduser()
        try:
            key = path.read_text(encoding="utf-8").strip()
        except OSError as e:
            raise ValueError(f"--api-key-file {str(path)!r} cannot be read: {e.strerror}") from e
        if not key:
            raise ValueError(f"--api-key-file {str(path)!r} is empty")
        return key
    return os.environ.get(env_var) or None


def json_value_problem(data: Any, *, check_ints: bool = True) -> tuple[str, str] | None:
    """The first value of parsed JSON that cannot be passed on, as ``(path, reason)``, or None.

    Python's ``json`` module accepts a lone UTF-16 surrogate (``"\\ud800"``) and integers of
    any size; neither can be encoded as UTF-8 or by C JSON encoders, so a server that hands
    them to a tokenizer or forwards them fails far from the request. ``path`` is dotted
    (``messages.0.content``); ``check_ints`` adds integers outside the 64-bit range.
    Clean data costs one ``orjson.dumps`` (milliseconds for megabytes); only data it refuses
    is walked, iteratively, to name the value.
    """
    try:
        orjson.dumps(data)
        return None
    except (TypeError, orjson.JSONEncodeError):
        pass
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and _has_surrogate(value):
                return path or "body", "contains a lone UTF-16 surrogate (invalid Unicode)"
        elif isinstance(value, dict):
            items = list(value.items())
            for key, _ in items:
                if isinstance(key, str) and not key.isascii() and _has_surrogate(key):
                    sub = f"{path}.{key!r}" if path else repr(key)
                    return sub, "is a key with a lone UTF-16 surrogate (invalid Unicode)"
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in reversed(items))
        elif isinstance(value, list):
            stack.extend(
                (f"{path}.{i}" if path else str(i), value[i]) for i in range(len(value) - 1, -1, -1)
            )
        elif check_ints and isinstance(value, int) and not isinstance(value, bool):
            if not _INT64_RANGE[0] <= value <= _INT64_RANGE[1]:
                return path or "body", "is an integer outside the 64-bit range"
    return None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


async def _refuse(
    scope: Scope,
    receive: Receive,
    send: Send,
    status: int,
    detail: str,
    shape: ErrorShape,
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    """Answer ``status`` with ``detail`` in ``shape``; a refused websocket is closed before accept."""
    if scope["type"] == "websocket":
        await receive()
        await send({"type": "websocket.close", "code": 1008, "reason": detail[:120]})
        return
    await send_error(send, status, detail, shape=shape, headers=headers)


class BearerAuthMiddleware:
    """Require ``Authorization: Bearer KEY`` on every path except the open ones (401 otherwise).

    ``shape`` writes the refusal's body (FastAPI's ``detail`` by default).
    """

    def __init__(
        self,
        app: ASGIApp,
        api_key: str,
        open_paths: Iterable[str] = ("/", "/health"),
        shape: ErrorShape = detail_error,
    ) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._open = frozenset(open_paths)
        self._shape = shape

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in self._open:
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"authorization") or b""
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        await _refuse(
            scope,
            receive,
            send,
            401,
            "missing or invalid API key: send 'Authorization: Bearer <key>'",
            self._shape,
            headers=[(b"www-authenticate", b"Bearer")],
        )


def _is_json_type(content_type: bytes | None) -> bool:
    if not content_type:
        return False
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (
        media.startswith(b"application/") and media.endswith(b"+json")
    )


def _has_body(scope: Scope) -> bool:
    length = _header(scope, b"content-length")
    if length is not None:
        try:
            return int(length) > 0
        except ValueError:
            return True
    return _header(scope, b"transfer-encoding") is not None


class BrowserGuardMiddleware:
    """Refuse what a foreign web page could make a browser send to a local server.

    ``allowed_origins`` are the ``--cors-origin`` values (``"*"`` allows any origin). The
    server's own origin (``scheme://Host`` of the request) is always allowed, so a page the server
    itself serves (the Gradio viewer) keeps working. ``require_json`` is a bool or a predicate on
    the path; ``guarded_get_paths`` are old ``GET`` endpoints that change state and stay open only
    to clients that are not browsers (a mapping gives each path the advice its 403 carries, such
    as the endpoint to use instead). ``open_paths`` skip every check (health probes). ``shape``
    writes the refusal's body.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        allowed_origins: Iterable[str] = (),
        check_host: bool = True,
        require_json: bool | Callable[[str], bool] = True,
        guarded_get_paths: Iterable[str] | Mapping[str, str] = (),
        open_paths: Iterable[str] = ("/health",),
        shape: ErrorShape = detail_error,
    ) -> None:
        self.app = app
        self._shape = shape
        origins = {o.strip().rstrip("/").lower() for o in allowed_origins if o and o.strip()}
        self._any_origin = "*" in origins
        self._origins = frozenset(origins - {"*"})
        self._check_host = check_host
        self._require_json = require_json
        self._guarded_gets: dict[str, str] = (
            dict(guarded_get_paths)
            if isinstance(guarded_get_paths, Mapping)
            else dict.fromkeys(guarded_get_paths, _GUARDED_GET_ADVICE)
        )
        self._open = frozenset(open_paths)

    def _needs_json(self, path: str) -> bool:
        rule = self._require_json
        return rule(path) if callable(rule) else bool(rule)

    def _problem(self, scope: Scope) -> tuple[int, str] | None:
        path = scope.get("path", "")
        method = scope.get("method", "GET")
        host_raw = _header(scope, b"host")
        host = host_raw.decode("latin-1") if host_raw is not None else ""
        if self._check_host and host_raw is not None and not is_loopback_host(host):
            return 403, (
                f"request refused: Host {host!r} is not a loopback name and this server listens on "
                "loopback (DNS-rebinding protection); connect to 127.0.0.1 or localhost, or bind "
                "a public address with --host"
            )
        origin_raw = _header(scope, b"origin")
        if origin_raw is not None and not self._any_origin:
            origin = origin_raw.decode("latin-1").strip().rstrip("/").lower()
            scheme = "https" if scope.get("scheme") in ("https", "wss") else "http"
            own = f"{scheme}://{host.strip().lower()}" if host else None
            if origin != own and origin not in self._origins:
                return 403, (
                    f"cross-origin request refused: Origin {origin!r} is not allowed "
                    f"(allow it with --cors-origin {origin})"
                )
        if scope["type"] != "http":
            return None
        fetch_site = (_header(scope, b"sec-fetch-site") or b"").lower()
        if path in self._guarded_gets and method in ("GET", "HEAD"):
            if origin_raw is not None or fetch_site in _BROWSER_CROSS_SITE:
                return 403, f"GET {path} from a browser is refused: {self._guarded_gets[path]}"
        if method in _BODY_METHODS and origin_raw is None and fetch_site in _BROWSER_CROSS_SITE:
            # A browser names the page's origin on every POST; one that withheld it while
            # saying the request comes from another site cannot be checked, so it is refused.
            return 403, (f"{method} {path} from another site without an Origin header is refused")
        if method in _BODY_METHODS and _has_body(scope) and self._needs_json(path):
            content_type = _header(scope, b"content-type")
            if not _is_json_type(content_type):
                shown = content_type.decode("latin-1") if content_type else "none"
                return 415, (
                    f"Content-Type {shown!r} is not accepted on {path}: send the body as "
                    "'application/json' (gzip Content-Encoding is fine)"
                )
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("path") in self._open:
            await self.app(scope, receive, send)
            return
        problem = self._problem(scope)
        if problem is None:
            await self.app(scope, receive, send)
            return
        status, detail = problem
        logger.warning("refused %s %s: %s", scope.get("method", "WS"), scope.get("path"), detail)
        await _refuse(scope, receive, send, status, detail, self._shape)
