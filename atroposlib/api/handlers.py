"""Request handling of the routes (:mod:`atroposlib.api.routes`) that take raw bodies.

Each function takes the store and raw inputs (body bytes, ids) and returns
the answer as JSON bytes; domain problems are raised as
:class:`~atroposlib.api.errors.ApiError`. Posted groups are validated once from
their JSON bytes (:mod:`~atroposlib.api.decode`) and kept as the posted bytes,
with absent fields added as nulls (see :func:`parse_groups`).
"""

from __future__ import annotations

import json
import logging
from typing import List, Sequence, TypeVar

from pydantic import BaseModel, ValidationError

from atroposlib.api import codec
from atroposlib.api.decode import ParsedGroup, parse_groups
from atroposlib.api.errors import (
    BodyValidationError,
    GroupInconsistentError,
    UnknownEnvError,
    invalid_body,
)
from atroposlib.api.models import check_lengths, check_token_ids
from atroposlib.api.store import IncomingGroup, RolloutStore

__all__ = [
    "ParsedGroup",
    "incoming",
    "ingest_groups",
    "parse_body",
    "parse_groups",
    "serve_batch",
    "status_env",
]

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


def parse_body(model: type[M], body: bytes) -> M:
    """Validate ``model`` from JSON bytes (whatever the Content-Type); 422 on failure."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise invalid_body(e) from None


def incoming(
    parsed: Sequence[ParsedGroup], many: bool, strict: bool, vocab_size: int | None = None
) -> tuple[List[IncomingGroup], List[tuple[int | None, str]]]:
    """Check each group's counts and lengths (docs/design.md, "Per-token fields") and its
    token ids against the trainer's ``vocab_size``; the groups to store and the lenient
    findings.

    The findings are ``(env_id, field)`` for optional per-token fields whose
    lengths disagree with ``tokens`` (accepted unless ``strict``).
    """
    out: List[IncomingGroup] = []
    findings: List[tuple[int | None, str]] = []
    for i, p in enumerate(parsed):
        loc = (i,) if many else ()
        for name in check_lengths(p.shape.rows, p.shape.scores, loc, strict):
            findings.append((p.shape.env_id, name))
        check_token_ids(p.shape.max_id, vocab_size, p.body, loc)
        out.append(
            IncomingGroup(
                env_id=p.shape.env_id,
                size=p.shape.size,
                body=p.body,
                version=p.shape.version,
                fill=p.fill,
            )
        )
    return out, findings


def ingest_groups(
    store: RolloutStore,
    body: bytes,
    many: bool,
    strict: bool | None = None,
    defer: bool = False,
) -> bytes:
    """``POST /scored_data`` (``many=False``) and ``/scored_data_list`` (``many=True``).

    ``strict`` (default: the store's ``strict_groups``, ``run-api
    --strict-groups``) rejects optional per-token fields whose lengths differ
    from ``tokens``; otherwise they are accepted, warned about and counted (docs/design.md, "Per-token fields").
    ``defer`` leaves the database commit to the caller (see :meth:`RolloutStore.ingest`).
    """
    if strict is None:
        strict = store.strict_groups
    try:
        groups, findings = incoming(parse_groups(body, many), many, strict, store.vocab_size)
        outcomes = store.ingest(groups, defer=defer)
    except (BodyValidationError, GroupInconsistentError) as e:
        store.count("rejected_invalid")
        logger.info("rejected a post: %s", e.message)
        raise
    except UnknownEnvError as e:
        store.count("rejected_unknown_env")
        logger.info("rejected a post: %s", e.message)
        raise
    if findings:
        store.note_inconsistent(findings)
    if many:
        return codec.list_answer([(o.status, o.buffer_size) for o in outcomes])
    outcome = outcomes[0]
    if outcome.status == "received":
        return codec.RECEIVED
    return codec.buffered_answer(outcome.buffer_size)


def serve_batch(store: RolloutStore, ack: str | None = None) -> bytes:
    """``GET /batch[?ack=ID]``: the oldest full batch as joined group JSON, or ``{"batch":null}``.

    ``ack`` is the client's last ``batch_id`` (None for clients that never send
    it); see :meth:`RolloutStore.serve_batch`.
    """
    if not store.registered:
        return codec.NOT_REGISTERED
    return store.batch_answer(ack)


def status_env(store: RolloutStore, env_id: int) -> bytes:
    """``GET /status-env``: the env's throttling signal."""
    return json.dumps(store.env_status(env_id)).encode()
