"""The rollout API's app (docs/design.md, "Rollout API routes"): one store, its guards, its routes.

``create_app(settings)`` builds one app around one :class:`RolloutStore`, kept on
``app.state.store``; every endpoint is a route of :data:`atroposlib.api.routes.router`
(``GET /``, ``/health``, ``/metrics``, ``/wandb_info``, ``/info``, ``/batch``,
``/status-env``, ``/latest_example``, ``/status``, ``/reset_data``; ``POST /register``,
``/register-env``, ``/disconnect-env``, ``/scored_data``, ``/scored_data_list``,
``/batch/ack``, ``/reset_data``). Around FastAPI sit the shared server guards
(:func:`~atroposlib.http.server.build_server`) and response gzip.
"""

from __future__ import annotations

import gc
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI

from atroposlib.api.compression import GzipResponseMiddleware
from atroposlib.api.errors import install_error_handlers
from atroposlib.api.group_commit import GroupCommit
from atroposlib.api.middleware import GZipRequestMiddleware
from atroposlib.api.models import (
    EnvIdentifier,
    Info,
    RegisterEnv,
    Registration,
    ScoredData,
    Status,
)
from atroposlib.api.recovery import open_persistence
from atroposlib.api.routes import SMALL_ANSWER_ROUTES, BatchAck, router
from atroposlib.api.settings import APISettings
from atroposlib.api.store import MIN_ENV_WEIGHT, RolloutStore
from atroposlib.http.asgi import ASGIApp, Receive, Scope, Send
from atroposlib.http.security import load_api_key
from atroposlib.http.server import ServerOptions, build_server
from atroposlib.utils.gc_tuning import startup_objects_frozen

logger = logging.getLogger(__name__)

__all__ = [
    "MIN_ENV_WEIGHT",
    "BatchAck",
    "EnvIdentifier",
    "GZipRequestMiddleware",
    "Info",
    "RegisterEnv",
    "Registration",
    "RolloutAPI",
    "ScoredData",
    "Status",
    "create_app",
]

_GC_GEN0_THRESHOLD = 20_000

_OPEN_PATHS = ("/", "/health")
_BROWSER_GUARDED_GETS = {
    "/reset_data": "use POST /reset_data",
    "/batch": "GET /batch hands out (and consumes) training batches and is for the trainer; "
    "to look at the data use GET /latest_example or GET /status",
}
"""GETs that change state: refused when a browser sends them (Origin or cross-site fetch),
with the advice the 403 carries."""


class _SkipFor:
    """Send the requests of ``routes`` (method, path) straight to ``direct``, the rest to ``app``."""

    def __init__(self, app: ASGIApp, direct: ASGIApp, routes: frozenset) -> None:
        self.app = app
        self.direct = direct
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (scope["method"], scope["path"]) in self.routes:
            await self.direct(scope, receive, send)
        else:
            await self.app(scope, receive, send)


class RolloutAPI(FastAPI):
    """A FastAPI app whose guards wrap FastAPI's own middleware stack.

    Requests pass the browser guard (foreign Origin, non-loopback Host, non-JSON
    bodies, browser GETs that change state), CORS (when origins are
    configured), bearer auth, the body guard (413, in-flight bound, gzip
    inflation) and response gzip before reaching FastAPI's routes, so every
    endpoint gets the same guards.
    """

    def __init__(self, *, settings: APISettings, store: RolloutStore, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.atropos_settings = settings
        self.atropos_store = store

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # HTTP requests go straight to the stack built below: FastAPI's per-request
        # telemetry hook is disabled for this app and would only cost time.
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        if self.root_path:
            scope["root_path"] = self.root_path
        scope["app"] = self
        if self.middleware_stack is None:
            self.middleware_stack = self.build_middleware_stack()
        await self.middleware_stack(scope, receive, send)

    def build_middleware_stack(self) -> ASGIApp:
        settings = self.atropos_settings
        routes = super().build_middleware_stack()
        gzipped = GzipResponseMiddleware(routes, minimum_size=1000, level=settings.gzip_level)
        # Ingest and /status-env answers are a few bytes: skip gzip's per-request work for them.
        app: ASGIApp = _SkipFor(gzipped, routes, SMALL_ANSWER_ROUTES)
        api_key = settings.api_key or load_api_key(None, settings.api_key_file, component="run-api")
        # Outermost the browser guard, so that a page in the user's browser cannot reach
        # anything (docs/design.md, "Security model"); then CORS, auth and the body bounds.
        return build_server(
            app,
            ServerOptions(
                bind_host=settings.host,
                api_key=api_key,
                allowed_origins=tuple(settings.cors_origins or ()),
                open_paths=_OPEN_PATHS,
                guarded_get_paths=_BROWSER_GUARDED_GETS,
                max_body_bytes=settings.max_request_bytes,
                max_inflight_bytes=settings.max_inflight_bytes,
                body_timeout=settings.body_timeout,
                inflate_gzip=True,
                body_hints={
                    "size": "run-api --max-request-mb",
                    "inflight": "run-api --max-inflight-mb",
                    "timeout": "run-api --body-timeout",
                },
            ),
        )


def create_app(settings: APISettings | None = None, store: RolloutStore | None = None) -> FastAPI:
    """Build the API app around one :class:`RolloutStore` (made from ``settings`` when not
    given; a given store keeps its own configuration, ``strict_groups`` included)."""
    settings = settings or APISettings()
    if store is None:
        persistence = (
            open_persistence(settings.persist, recover=settings.persist_recover)
            if settings.persist
            else None
        )
        store = RolloutStore(
            settings.max_queue_bytes,
            persistence,
            settings.pack_above_bytes,
            max_buffer_bytes=settings.max_buffer_bytes,
            env_timeout=settings.env_timeout,
            max_staleness=settings.max_staleness,
            strict_groups=settings.strict_groups,
        )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Validating a group allocates a few dozen lists that die with the request; a larger
        # first-generation threshold runs the collector every ~1,000 posts instead of every ~30.
        threshold = gc.get_threshold()
        gc.set_threshold(max(threshold[0], _GC_GEN0_THRESHOLD), *threshold[1:])
        try:
            # Startup objects are long-lived: keep the cyclic GC from rescanning them on the
            # hot path (and undo it when the app stops, for apps run inside a test process).
            with startup_objects_frozen():
                yield
        finally:
            gc.set_threshold(*threshold)
            store.close()

    app = RolloutAPI(
        settings=settings,
        store=store,
        title="AtroposLib API",
        lifespan=lifespan,
        telemetry={"tracing": False, "metrics": False},
        # The router's routes themselves, in its order: FastAPI tries them one by one, and
        # an included router would add a layer of matching to every request.
        routes=list(router.routes),
    )
    app.state.store = store
    app.state.settings = settings
    app.state.group_commit = GroupCommit(store)
    install_error_handlers(app)
    return app


_app: FastAPI | None = None


def __getattr__(name: str) -> Any:
    """``app`` (the original's module-level FastAPI app), built on first access from ``ATROPOS_*``."""
    global _app
    if name == "app":
        if _app is None:
            _app = create_app(APISettings())
        return _app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
