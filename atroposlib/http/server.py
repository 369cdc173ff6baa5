"""The one stack in front of every server we ship: guard -> CORS -> auth -> size limit.

run-api, ``atropos-serve-model``, the OpenAI proxy and ``view-run`` each declare their
routes and their domain; what stands between the socket and those routes is built here, in
one order for all of them (docs/design.md, "Security model"):

1. :class:`~atroposlib.http.security.BrowserGuardMiddleware`, outermost, so a page in the
   user's browser reaches nothing (not even CORS preflights) from a foreign origin or a
   rebound ``Host``;
2. Starlette's ``CORSMiddleware`` when origins are allowed, outside the key check because a
   browser's preflight carries no ``Authorization`` header;
3. :class:`~atroposlib.http.security.BearerAuthMiddleware` when a key is configured;
4. :class:`~atroposlib.http.body.BodyLimitMiddleware`, so no body is read before the
   request passed the checks above.

:func:`server_middleware` returns that stack as Starlette ``Middleware`` entries (what a
``FastAPI(middleware=...)`` or a Gradio app takes); :func:`build_server` puts it in front of
an app.

Example::

    app = build_server(app, ServerOptions(bind_host="127.0.0.1", api_key=key,
                                          max_body_bytes=64 << 20))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

from atroposlib.http.answers import ErrorShape, detail_error
from atroposlib.http.asgi import ASGIApp
from atroposlib.http.body import BODY_TIMEOUT, BodyLimitMiddleware
from atroposlib.http.security import BearerAuthMiddleware, BrowserGuardMiddleware, is_loopback_host

__all__ = ["ServerOptions", "build_server", "server_middleware"]


@dataclass(frozen=True)
class ServerOptions:
    """What the stack in front of a server needs to know.

    ``bind_host`` is the address the server listens on: a loopback one turns on the guard's
    ``Host`` check (None: no check, for apps driven in-process). ``allowed_origins`` are the
    ``--cors-origin`` values (``"*"``: any). ``api_key`` (None: no auth) is required on every
    path but ``open_paths``; the guard skips ``open_paths`` except ``/``. ``max_body_bytes``
    (None: no body layer) bounds each request body, ``max_inflight_bytes`` all of them at
    once. ``shape`` writes every refusal's body, so each server answers in one format.
    ``allow_any_origin`` turns the guard's origin and ``Host`` checks off (a public tunnel
    reaches the app under names we cannot know).
    """

    bind_host: str | None
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    open_paths: tuple[str, ...] = ("/", "/health")
    require_json: bool | Callable[[str], bool] = True
    guarded_get_paths: Mapping[str, str] = field(default_factory=dict)
    max_body_bytes: int | None = None
    max_inflight_bytes: int | None = None
    body_timeout: float | None = BODY_TIMEOUT
    inflate_gzip: bool = False
    body_hints: Mapping[str, str] = field(default_factory=dict)
    shape: ErrorShape = detail_error
    allow_any_origin: bool = False


def server_middleware(options: ServerOptions) -> list[Middleware]:
    """The stack for ``options``, outermost first: guard, CORS, auth, size limit."""
    origins = tuple(options.allowed_origins)
    any_origin = options.allow_any_origin
    stack = [
        Middleware(
            BrowserGuardMiddleware,
            allowed_origins=("*",) if any_origin else origins,
            check_host=(
                not any_origin
                and options.bind_host is not None
                and is_loopback_host(options.bind_host)
            ),
            require_json=options.require_json,
            guarded_get_paths=dict(options.guarded_get_paths),
            open_paths=tuple(p for p in options.open_paths if p != "/"),
            shape=options.shape,
        )
    ]
    if origins:
        stack.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(origins),
                allow_methods=["*"],
                allow_headers=["*"],
                allow_credentials=True,
            )
        )
    if options.api_key:
        stack.append(
            Middleware(
                BearerAuthMiddleware,
                api_key=options.api_key,
                open_paths=options.open_paths,
                shape=options.shape,
            )
        )
    if options.max_body_bytes is not None:
        stack.append(
            Middleware(
                BodyLimitMiddleware,
                max_bytes=options.max_body_bytes,
                max_inflight_bytes=options.max_inflight_bytes,
                body_timeout=options.body_timeout,
                inflate_gzip=options.inflate_gzip,
                shape=options.shape,
                hints=dict(options.body_hints),
            )
        )
    return stack


def wrap(app: ASGIApp, stack: Iterable[Middleware]) -> ASGIApp:
    """``app`` behind ``stack`` (outermost first), as Starlette builds its middleware."""
    for cls, args, kwargs in reversed(list(stack)):
        app = cls(app, *args, **kwargs)
    return app


def build_server(app: ASGIApp, options: ServerOptions) -> ASGIApp:
    """Put the stack for ``options`` in front of ``app`` and return what to serve.

    A Starlette (FastAPI) app gets the stack as its outermost user middleware and is
    returned itself, so its ``state`` and routes stay reachable; any other ASGI app is
    returned wrapped.
    """
    stack = server_middleware(options)
    if isinstance(app, Starlette):
        if app.middleware_stack is not None:
            raise RuntimeError("build_server: the app has already started serving")
        app.user_middleware[:0] = stack
        return app
    return wrap(app, stack)
