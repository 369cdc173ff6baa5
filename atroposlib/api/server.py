"""The rollout API's HTTP routes (SPEC §2.3): parse, call the :class:`RolloutStore`, answer.

``create_app(settings)`` builds one app around one store. The hot endpoints
(``/scored_data``, ``/scored_data_list``, ``/batch``) read and write raw bytes:
a posted group is validated once from its JSON bytes and kept as canonical
JSON, and a batch is the join of stored groups, never re-parsed.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, List, Optional, Sequence, TypeVar

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.middleware.gzip import GZipMiddleware

from atroposlib.api.errors import install_error_handlers, validation_detail
from atroposlib.api.metrics import CONTENT_TYPE, render_metrics
from atroposlib.api.middleware import BearerAuthMiddleware, RequestBodyMiddleware
from atroposlib.api.models import (
    EnvIdentifier,
    RegisterEnv,
    Registration,
    ScoredData,
    ScoredDataList,
    check_group_consistency,
)
from atroposlib.api.persistence import SqlitePersistence
from atroposlib.api.settings import APISettings
from atroposlib.api.store import MIN_ENV_WEIGHT, IncomingGroup, RolloutStore

logger = logging.getLogger(__name__)

__all__ = ["MIN_ENV_WEIGHT", "create_app"]

_JSON = "application/json"
_RECEIVED = b'{"status":"received"}'
_NOT_REGISTERED = {"status": "error", "message": "Trainer not registered. Call /register first.", "batch": []}
_PLACEHOLDER_EXAMPLE = {
    key: [] for key in ("tokens", "masks", "scores", "advantages", "ref_logprobs", "generation_params",
                        "inference_logprobs", "messages", "images")
}
_GROUP_SCHEMA = ScoredData.model_json_schema()
_SCORED_DATA_BODY = {"requestBody": {"required": True, "content": {_JSON: {"schema": _GROUP_SCHEMA}}}}
_SCORED_LIST_BODY = {"requestBody": {"required": True, "content": {
    _JSON: {"schema": {"type": "array", "items": _GROUP_SCHEMA, "title": "ScoredDataList"}}}}}
M = TypeVar("M", bound=BaseModel)
_to_json = ScoredData.__pydantic_serializer__.to_json


_FIELD_NULLS = {name: b'"%s":null,' % name.encode() for name in ScoredData.model_fields}


def _incoming(group: ScoredData, loc: tuple = (), raw: Optional[bytes] = None) -> IncomingGroup:
    """Check a validated group and keep it as canonical JSON with every field present.

    When the posted bytes are at hand they are kept as they are (strict
    validation guarantees they hold exactly the validated values), with the
    absent fields added as nulls; this skips a full re-serialisation.
    """
    check_group_consistency(group, loc)
    if raw is None:
        body = _to_json(group)
    else:
        missing = b"".join(v for k, v in _FIELD_NULLS.items() if k not in group.model_fields_set)
        body = b"{" + missing + raw.strip()[1:] if missing else raw.strip()
    return IncomingGroup(env_id=group.env_id, size=len(group.tokens), body=body)


def _body_of(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI ``requestBody`` for a route that parses ``model`` from the raw body itself."""
    return {"requestBody": {"required": True, "content": {_JSON: {"schema": model.model_json_schema()}}}}


def _parse(model: type[M], body: bytes) -> M:
    """Validate ``model`` from JSON bytes (whatever the Content-Type), errors as FastAPI 422s."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise RequestValidationError(validation_detail(e.errors(include_url=False, include_input=False)))


def _parse_groups(body: bytes, many: bool) -> List[IncomingGroup]:
    try:
        if many:
            groups = ScoredDataList.validate_json(body)
            return [_incoming(g, (i,)) for i, g in enumerate(groups)]
        return [_incoming(ScoredData.model_validate_json(body), raw=body)]
    except ValidationError as e:
        raise RequestValidationError(validation_detail(e.errors(include_url=False, include_input=False)))


def create_app(settings: Optional[APISettings] = None, store: Optional[RolloutStore] = None) -> FastAPI:
    """Build the API app around one :class:`RolloutStore` (made from ``settings`` when not given)."""
    settings = settings or APISettings()
    if store is None:
        persistence = SqlitePersistence(settings.persist) if settings.persist else None
        store = RolloutStore(settings.max_queue_bytes, persistence)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        store.close()

    app = FastAPI(title="AtroposLib API", lifespan=lifespan)
    app.state.store = store
    install_error_handlers(app)
    _add_routes(app, store)
    # Added innermost first: requests pass CORS, then auth, then the body guard, then gzip.
    app.add_middleware(GZipMiddleware, minimum_size=1000, compresslevel=settings.gzip_level)
    app.add_middleware(RequestBodyMiddleware, max_bytes=settings.max_request_bytes)
    if settings.api_key:
        app.add_middleware(BearerAuthMiddleware, api_key=settings.api_key)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=True)
    return app


def _ingest_answer(outcomes: Sequence[Any]) -> dict[str, Any]:
    buffered = [o for o in outcomes if o.status == "buffered"]
    answer: dict[str, Any] = {"status": "received", "groups_processed": len(outcomes)}
    if buffered:
        answer["buffered"] = len(buffered)
        answer["last_buffer_size"] = buffered[-1].buffer_size
    return answer


def _add_routes(app: FastAPI, store: RolloutStore) -> None:
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
        return {"uuid": store.register_trainer(_parse(Registration, await request.body()))}

    @app.post("/register-env", openapi_extra=_body_of(RegisterEnv))
    async def register_env(request: Request) -> dict:
        """Register an environment once the trainer has polled /batch."""
        answer = store.register_env(_parse(RegisterEnv, await request.body()))
        return answer if answer is not None else {"status": "wait for trainer to start"}

    @app.post("/disconnect-env", openapi_extra=_body_of(EnvIdentifier))
    async def disconnect_env(request: Request) -> dict:
        """Mark an environment disconnected (404 for an unknown env_id)."""
        store.disconnect_env(_parse(EnvIdentifier, await request.body()).env_id)
        return {"status": "success"}

    @app.get("/wandb_info")
    async def wandb_info() -> dict:
        """The trainer's W&B group and project (None before registration)."""
        return {"group": store.wandb_group, "project": store.wandb_project}

    @app.get("/info")
    async def info() -> dict:
        """Batch size and max token length (-1 before registration)."""
        return {"batch_size": store.batch_size, "max_token_len": store.max_token_len}

    @app.get("/batch")
    async def batch() -> Response:
        """Serve the oldest full batch (one per call) and count a step; ``{"batch": null}`` when short."""
        if not store.registered:
            return JSONResponse(_NOT_REGISTERED)
        groups = store.next_batch()
        if groups is None:
            return Response(b'{"batch":null}', media_type=_JSON)
        return Response(b'{"batch":[' + b",".join(groups) + b"]}", media_type=_JSON)

    @app.get("/latest_example")
    async def latest_example() -> Response:
        """The last group put on the queue, or empty placeholders."""
        if store.latest is None:
            return JSONResponse(_PLACEHOLDER_EXAMPLE)
        return Response(store.latest, media_type=_JSON)

    @app.post("/scored_data", openapi_extra=_SCORED_DATA_BODY)
    async def scored_data(request: Request) -> Response:
        """Accept one scored group (422 on inconsistent fields, 503 + Retry-After when full)."""
        groups = _parse_groups(await request.body(), many=False)
        outcome = store.ingest(groups)[0]
        if outcome.status == "received":
            return Response(_RECEIVED, media_type=_JSON)
        return JSONResponse({"status": "buffered", "buffer_size": outcome.buffer_size})

    @app.post("/scored_data_list", openapi_extra=_SCORED_LIST_BODY)
    async def scored_data_list(request: Request) -> dict:
        """Accept several groups at once, all or none."""
        groups = _parse_groups(await request.body(), many=True)
        return _ingest_answer(store.ingest(groups))

    @app.get("/status")
    async def status() -> dict:
        """Current step and number of queued groups."""
        return {"current_step": store.step, "queue_size": len(store.queue)}

    @app.get("/status-env")
    async def status_env(
        request: Request, env_id: Optional[int] = Query(None, description="The asking env's id.")
    ) -> dict:
        """An env's throttling signal; ``env_id`` as query parameter or (old clients) JSON body."""
        if env_id is None:
            body = await request.body()
            if not body.strip():
                raise RequestValidationError([{"type": "missing", "loc": ["query", "env_id"],
                                               "msg": "env_id is required: GET /status-env?env_id=N"}])
            env_id = _parse(EnvIdentifier, body).env_id
        return store.env_status(env_id)

    @app.get("/reset_data", response_class=PlainTextResponse)
    async def reset_data() -> PlainTextResponse:
        """Forget queue, envs and registration."""
        store.reset()
        return PlainTextResponse("Reset successful")
