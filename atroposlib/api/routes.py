"""The routes of ``run-api`` (docs/design.md, "Rollout API routes"), declared once on :data:`router`.

Each handler reads the :class:`~atroposlib.api.store.RolloutStore` from ``app.state.store``
(see :func:`rollout_store`), parses, calls the store and answers. The endpoints called in a
loop (``/scored_data``, ``/scored_data_list``, ``/batch``, ``/status-env``) take the raw
body and answer ready-made JSON bytes: a posted group is validated once, from its bytes,
by :mod:`~atroposlib.api.decode`, and a batch is joined from the stored bytes, so neither
passes through FastAPI's body parsing or response encoding. ``create_app`` wires the
router into the app (:mod:`atroposlib.api.server`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel

from atroposlib.api import handlers
from atroposlib.api.errors import BodyValidationError
from atroposlib.api.group_commit import GroupCommit
from atroposlib.api.metrics import CONTENT_TYPE, render_metrics
from atroposlib.api.models import EnvIdentifier, RegisterEnv, Registration, ScoredData
from atroposlib.api.store import RolloutStore

__all__ = ["SMALL_ANSWER_ROUTES", "BatchAck", "rollout_store", "router"]

router = APIRouter()

SMALL_ANSWER_ROUTES = frozenset(
    {("POST", "/scored_data"), ("POST", "/scored_data_list"), ("GET", "/status-env")}
)
"""Routes whose answers are far below the gzip threshold (errors included): gzip can skip them."""

_JSON = "application/json"
_GROUP_SCHEMA = ScoredData.model_json_schema()
_GROUP_LIST_SCHEMA = {"type": "array", "items": _GROUP_SCHEMA, "title": "ScoredDataList"}
_ACK_DESCRIPTION = (
    "batch_id of the last batch received (empty when none): that batch is consumed; any other "
    "unacknowledged batch is served again. Without ack, this call acknowledges the previous batch."
)
_ENV_ID_DESCRIPTION = "The asking env's id."
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


class BatchAck(BaseModel):
    """``POST /batch/ack`` body: the ``batch_id`` of a ``/batch`` answer the trainer is done with."""

    batch_id: str


def rollout_store(request: Request) -> RolloutStore:
    """The app's one store (``app.state.store``, set by ``create_app``)."""
    return request.app.state.store


def _body_of(schema: dict[str, Any] | type[BaseModel]) -> dict[str, Any]:
    """OpenAPI ``requestBody`` of a route that validates its raw body itself."""
    if isinstance(schema, type):
        schema = schema.model_json_schema()
    return {"requestBody": {"required": True, "content": {_JSON: {"schema": schema}}}}


def _json(payload: bytes) -> Response:
    return Response(payload, media_type=_JSON)


async def _ingest(request: Request, many: bool) -> Response:
    state = request.app.state
    answer = handlers.ingest_groups(state.store, await request.body(), many=many, defer=True)
    commit: GroupCommit = state.group_commit
    await commit.wait()  # answered only once the group is on disk (with --persist)
    return _json(answer)


# The routes called in a loop come first: FastAPI tries routes in the order declared.
@router.post("/scored_data", openapi_extra=_body_of(_GROUP_SCHEMA))
async def scored_data(request: Request) -> Response:
    """Accept one scored group (422 on inconsistent fields, 503 + Retry-After when full)."""
    return await _ingest(request, many=False)


@router.post("/scored_data_list", openapi_extra=_body_of(_GROUP_LIST_SCHEMA))
async def scored_data_list(request: Request) -> Response:
    """Accept several groups at once, all or none."""
    return await _ingest(request, many=True)


@router.get("/batch")
async def batch(
    request: Request, ack: str | None = Query(None, description=_ACK_DESCRIPTION)
) -> Response:
    """Serve the oldest full batch (one per call) and count a step; ``{"batch": null}`` when short.

    The answer carries ``batch_id`` and ``step``; the batch stays recoverable
    until acknowledged (see the API README, "Delivery").
    """
    return _json(handlers.serve_batch(request.app.state.store, ack))


@router.get("/status-env")
async def status_env(
    request: Request, env_id: int | None = Query(None, description=_ENV_ID_DESCRIPTION)
) -> Response:
    """An env's throttling signal; ``env_id`` as query parameter or (old clients) JSON body."""
    if env_id is None:
        # The original's clients send ``{"env_id": N}`` as the body of the GET.
        body = await request.body()
        if not body.strip():
            raise BodyValidationError(
                [
                    {
                        "type": "missing",
                        "loc": ["query", "env_id"],
                        "msg": "env_id is required: GET /status-env?env_id=N",
                    }
                ]
            )
        env_id = handlers.parse_body(EnvIdentifier, body).env_id
    return _json(handlers.status_env(request.app.state.store, env_id))


@router.get("/")
async def root() -> dict:
    """Liveness message of the original API."""
    return {"message": "AtroposLib API"}


@router.get("/health")
async def health() -> dict:
    """Health check (open even with --api-key)."""
    return {"status": "ok"}


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(store: RolloutStore = Depends(rollout_store)) -> Response:
    """Prometheus text: queue per env, ingest and batch counters, step, envs."""
    return Response(render_metrics(store), media_type=CONTENT_TYPE)


@router.post("/register", openapi_extra=_body_of(Registration))
async def register(request: Request, store: RolloutStore = Depends(rollout_store)) -> dict:
    """Register the trainer. Only the first call since start or reset sets the config."""
    return {"uuid": store.register_trainer(handlers.parse_body(Registration, await request.body()))}


@router.post("/register-env", openapi_extra=_body_of(RegisterEnv))
async def register_env(request: Request, store: RolloutStore = Depends(rollout_store)) -> dict:
    """Register an environment once the trainer has polled /batch."""
    answer = store.register_env(handlers.parse_body(RegisterEnv, await request.body()))
    return answer if answer is not None else {"status": "wait for trainer to start"}


@router.post("/disconnect-env", openapi_extra=_body_of(EnvIdentifier))
async def disconnect_env(request: Request, store: RolloutStore = Depends(rollout_store)) -> dict:
    """Mark an environment disconnected (404 for an unknown env_id)."""
    store.disconnect_env(handlers.parse_body(EnvIdentifier, await request.body()).env_id)
    return {"status": "success"}


@router.get("/wandb_info")
async def wandb_info(store: RolloutStore = Depends(rollout_store)) -> dict:
    """The trainer's W&B group and project (None before registration)."""
    return {"group": store.wandb_group, "project": store.wandb_project}


@router.get("/info")
async def info(store: RolloutStore = Depends(rollout_store)) -> dict:
    """Batch size and max token length (-1 before registration)."""
    return {"batch_size": store.batch_size, "max_token_len": store.max_token_len}


@router.post("/batch/ack", openapi_extra=_body_of(BatchAck))
async def batch_ack(request: Request, store: RolloutStore = Depends(rollout_store)) -> dict:
    """Acknowledge (consume) the batch ``batch_id``; idempotent, 404 for an unknown id."""
    ack = handlers.parse_body(BatchAck, await request.body())
    return {"status": store.acknowledge(ack.batch_id), "batch_id": ack.batch_id}


@router.get("/latest_example")
async def latest_example(store: RolloutStore = Depends(rollout_store)) -> Response:
    """The last group put on the queue, or empty placeholders."""
    if store.latest is None:
        return JSONResponse(_PLACEHOLDER_EXAMPLE)
    return _json(store.latest)


@router.get("/status")
async def status(store: RolloutStore = Depends(rollout_store)) -> dict:
    """Current step and queued groups, plus buffered groups, the unacknowledged batch
    and the envs silent for longer than --env-timeout."""
    return store.status()


@router.post("/reset_data", response_class=PlainTextResponse)
async def reset_data(store: RolloutStore = Depends(rollout_store)) -> PlainTextResponse:
    """Forget queue, envs and registration."""
    store.reset()
    return PlainTextResponse("Reset successful")


@router.get("/reset_data", response_class=PlainTextResponse, include_in_schema=False)
async def reset_data_get(store: RolloutStore = Depends(rollout_store)) -> PlainTextResponse:
    """The original's GET form, for old clients; refused to browsers (see the guard)."""
    store.reset()
    return PlainTextResponse("Reset successful")
