"""The rollout API's HTTP routes (docs/design.md, "Rollout API routes"): parse, call the :class:`RolloutStore`, answer.

``create_app(settings)`` builds one app around one store. The hot endpoints
(``/scored_data``, ``/scored_data_list``, ``/batch``, ``/status-env``) are declared
and answered only by :class:`~atroposlib.api.fastpath.HotPathMiddleware`, their
schema merged into this app's; the routes here serve everything else.
"""

from __future__ import annotations

import gc
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel

from atroposlib.api import handlers
from atroposlib.api.compression import GzipResponseMiddleware
from atroposlib.api.errors import install_error_handlers
from atroposlib.api.fastpath import (
    SMALL_ANSWER_ROUTES,
    BypassFor,
    HotPathMiddleware,
    openapi_paths,
    openapi_schemas,
)
from atroposlib.api.metrics import CONTENT_TYPE, render_metrics
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
from atroposlib.api.settings import APISettings
from atroposlib.api.store import MIN_ENV_WEIGHT, RolloutStore
from atroposlib.http.asgi import ASGIApp, Receive, Scope, Send
from atroposlib.http.security import load_api_key
from atroposlib.http.server import ServerOptions, build_server
from atroposlib.utils.gc_tuning import startup_objects_frozen

logger = logging.getLogger(__name__)

__all__ = [
    "MIN_ENV_WEIGHT",
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

_JSON = "application/json"
_GC_GEN0_THRESHOLD = 20_000
_PLACEHOLDER_EXAMPLE = {
    key: []
    for key in (
        "tokens",
        "masks",
        "scores",
        "advantages",
        "ref_logprobs",
        "generation_params",
        "inference_logprobs",
        "messages",
        "images",
    )
}


def _body_of(schema: dict[str, Any] | type[BaseModel]) -> dict[str, Any]:
    """OpenAPI ``requestBody`` for a route that parses its raw body itself."""
    if isinstance(schema, type):
        schema = schema.model_json_schema()
    return {"requestBody": {"required": True, "content": {_JSON: {"schema": schema}}}}


class BatchAck(BaseModel):
    """``POST /batch/ack`` body: the ``batch_id`` of a ``/batch`` answer the trainer is done with."""

    batch_id: str


_OPEN_PATHS = ("/", "/health")
_BROWSER_GUARDED_GETS = {
    "/reset_data": "use POST /reset_data",
    "/batch": "GET /batch hands out (and consumes) training batches and is for the trainer; "
    "to look at the data use GET /latest_example or GET /status",
}
"""GETs that change state: refused when a browser sends them (Origin or cross-site fetch),
with the advice the 403 carries."""


class RolloutAPI(FastAPI):
    """A FastAPI app whose guards and hot path wrap FastAPI's own middleware stack.

    Requests pass the browser guard (foreign Origin, non-loopback Host, non-JSON
    bodies, browser GETs that change state), CORS (when origins are
    configured), bearer auth, the body guard (413, in-flight bound, gzip
    inflation), response gzip and the hot path before
    reaching FastAPI, so the endpoints called in a loop skip FastAPI's
    per-request machinery while every endpoint gets the same guards.
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
        hot = HotPathMiddleware(super().build_middleware_stack(), self.atropos_store)
        gzipped = GzipResponseMiddleware(hot, minimum_size=1000, level=settings.gzip_level)
        # Ingest and /status-env answers are a few bytes: skip gzip's per-request work for them.
        app: ASGIApp = BypassFor(gzipped, hot, SMALL_ANSWER_ROUTES)
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
    )
    install_error_handlers(app)
    _add_routes(app, store)
    return app


def _json(payload: bytes) -> Response:
    return Response(payload, media_type=_JSON)


def _add_routes(app: FastAPI, store: RolloutStore) -> None:
    """The routes FastAPI answers, and the schema of those the hot path answers
    (:data:`~atroposlib.api.fastpath.HOT_ENDPOINTS`, declared there once)."""
    fastapi_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        schema = fastapi_openapi()
        schema["paths"].update(openapi_paths())
        schema.setdefault("components", {}).setdefault("schemas", {}).update(openapi_schemas())
        return schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.get("/")
    async def root() -> dict:
        """Liveness message of the original API."""
        return {"message": "AtroposLib API"}

    @app.get("/health")
    async def health() -> dict:
        """Health check (open even with --api-key)."""
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        """Prometheus text: queue per env, ingest and batch counters, step, envs."""
        return Response(render_metrics(store), media_type=CONTENT_TYPE)

    @app.post("/register", openapi_extra=_body_of(Registration))
    async def register(request: Request) -> dict:
        """Register the trainer. Only the first call since start or reset sets the config."""
        return {
            "uuid": store.register_trainer(handlers.parse_body(Registration, await request.body()))
        }

    @app.post("/register-env", openapi_extra=_body_of(RegisterEnv))
    async def register_env(request: Request) -> dict:
        """Register an environment once the trainer has polled /batch."""
        answer = store.register_env(handlers.parse_body(RegisterEnv, await request.body()))
        return answer if answer is not None else {"status": "wait for trainer to start"}

    @app.post("/disconnect-env", openapi_extra=_body_of(EnvIdentifier))
    async def disconnect_env(request: Request) -> dict:
        """Mark an environment disconnected (404 for an unknown env_id)."""
        store.disconnect_env(handlers.parse_body(EnvIdentifier, await request.body()).env_id)
        return {"status": "success"}

    @app.get("/wandb_info")
    async def wandb_info() -> dict:
        """The trainer's W&B group and project (None before registration)."""
        return {"group": store.wandb_group, "project": store.wandb_project}

    @app.get("/info")
    async def info() -> dict:
        """Batch size and max token length (-1 before registration)."""
        return {"batch_size": store.batch_size, "max_token_len": store.max_token_len}

    @app.post("/batch/ack", openapi_extra=_body_of(BatchAck))
    async def batch_ack(request: Request) -> dict:
        """Acknowledge (consume) the batch ``batch_id``; idempotent, 404 for an unknown id."""
        ack = handlers.parse_body(BatchAck, await request.body())
        return {"status": store.acknowledge(ack.batch_id), "batch_id": ack.batch_id}

    @app.get("/latest_example")
    async def latest_example() -> Response:
        """The last group put on the queue, or empty placeholders."""
        if store.latest is None:
            return JSONResponse(_PLACEHOLDER_EXAMPLE)
        return _json(store.latest)

    @app.get("/status")
    async def status() -> dict:
        """Current step and queued groups, plus buffered groups, the unacknowledged batch
        and the envs silent for longer than --env-timeout."""
        return store.status()

    @app.post("/reset_data", response_class=PlainTextResponse)
    async def reset_data() -> PlainTextResponse:
        """Forget queue, envs and registration."""
        store.reset()
        return PlainTextResponse("Reset successful")

    @app.get("/reset_data", response_class=PlainTextResponse, include_in_schema=False)
    async def reset_data_get() -> PlainTextResponse:
        """The original's GET form, for old clients; refused to browsers (see the guard)."""
        store.reset()
        return PlainTextResponse("Reset successful")


_app: FastAPI | None = None


def __getattr__(name: str) -> Any:
    """``app`` (the original's module-level FastAPI app), built on first access from ``ATROPOS_*``."""
    global _app
    if name == "app":
        if _app is None:
            _app = create_app(APISettings())
        return _app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
