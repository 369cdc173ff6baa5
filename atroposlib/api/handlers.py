"""Request handling shared by the FastAPI routes and the raw-ASGI hot path.

Each function takes the store and raw inputs (body bytes, ids) and returns
the answer as JSON bytes; domain problems are raised as
:class:`~atroposlib.api.errors.ApiError`. Posted groups are validated once from
their JSON bytes and kept as canonical JSON (see :func:`incoming`).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, List, Sequence, TypeVar

from pydantic import BaseModel, ValidationError

from atroposlib.api.errors import (
    BodyValidationError,
    GroupInconsistentError,
    UnknownEnvError,
    validation_detail,
)
from atroposlib.api.models import ScoredData, ScoredDataList, check_group_consistency
from atroposlib.api.store import IncomingGroup, IngestOutcome, RolloutStore

__all__ = ["ingest_groups", "incoming", "parse_body", "serve_batch", "status_env"]

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

RECEIVED = b'{"status":"received"}'
NOT_REGISTERED = {
    "status": "error",
    "message": "Trainer not registered. Call /register first.",
    "batch": [],
}
_FIELD_NULLS = {name: b'"%s":null,' % name.encode() for name in ScoredData.model_fields}
_missing_cache: dict[frozenset, bytes] = {}


def _missing_nulls(present: set) -> bytes:
    """``"field":null,`` for every field absent from the posted group (cached per field set)."""
    key = frozenset(present)
    nulls = _missing_cache.get(key)
    if nulls is None:
        nulls = b"".join(v for k, v in _FIELD_NULLS.items() if k not in key)
        if len(_missing_cache) < 4096:
            _missing_cache[key] = nulls
    return nulls


_to_json = ScoredData.__pydantic_serializer__.to_json


def _invalid(e: ValidationError, prefix: Sequence[Any] = ("body",)) -> BodyValidationError:
    return BodyValidationError(
        validation_detail(e.errors(include_url=False, include_input=False), prefix)
    )


def parse_body(model: type[M], body: bytes) -> M:
    """Validate ``model`` from JSON bytes (whatever the Content-Type); 422 on failure."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise _invalid(e) from None


def incoming(group: ScoredData, loc: tuple = (), raw: bytes | None = None) -> IncomingGroup:
    """Check a validated group and keep it as canonical JSON with every field present.

    When the posted bytes are at hand they are kept as they are (strict
    validation guarantees they hold exactly the validated values), with the
    absent fields added as nulls; this skips a full re-serialisation.
    """
    check_group_consistency(group, loc)
    if raw is None:
        body = _to_json(group)
    else:
        missing = _missing_nulls(group.model_fields_set)
        start = raw.index(b"{")  # only JSON whitespace can precede it: validation passed
        body = b"".join((b"{", missing, memoryview(raw)[start + 1 :])) if missing else raw.strip()
    return IncomingGroup(env_id=group.env_id, size=len(group.tokens), body=body)


# Between two elements of a JSON array of objects there is only whitespace and a comma.
_BETWEEN_OBJECTS = re.compile(rb"\}[ \t\n\r]*,[ \t\n\r]*\{")


def element_bytes(body: bytes, count: int) -> List[bytes] | None:
    """The raw bytes of each object of ``body``, a *validated* JSON array of ``count`` objects.

    Every boundary between two top-level objects matches ``}\\s*,\\s*{``; the
    same text can also occur inside an element (nested objects, strings). So
    when exactly ``count - 1`` matches exist they are the boundaries, and
    otherwise the answer is None (the caller re-serialises instead).
    """
    if count == 0:
        return []
    cuts = list(_BETWEEN_OBJECTS.finditer(body))
    if len(cuts) != count - 1:
        return None
    starts = [body.index(b"{")] + [m.end() - 1 for m in cuts]
    ends = [m.start() + 1 for m in cuts] + [body.rindex(b"}") + 1]
    return [body[a:b] for a, b in zip(starts, ends, strict=True)]


def parse_groups(body: bytes, many: bool) -> List[IncomingGroup]:
    """Validate one group (or a list of groups) from the posted bytes.

    Groups are kept as their posted bytes (see :func:`incoming`); a list's
    elements are cut out of the body by :func:`element_bytes`, and re-serialised
    only when that is ambiguous.
    """
    try:
        if many:
            groups = ScoredDataList.validate_json(body)
            raws: Sequence[bytes | None] = element_bytes(body, len(groups)) or [None] * len(groups)
            return [
                incoming(g, (i,), raw) for i, (g, raw) in enumerate(zip(groups, raws, strict=True))
            ]
        return [incoming(ScoredData.model_validate_json(body), raw=body)]
    except ValidationError as e:
        raise _invalid(e) from None


def _list_answer(outcomes: Sequence[IngestOutcome]) -> dict[str, Any]:
    buffered = [o for o in outcomes if o.status == "buffered"]
    answer: dict[str, Any] = {"status": "received", "groups_processed": len(outcomes)}
    if buffered:
        answer["buffered"] = len(buffered)
        answer["last_buffer_size"] = buffered[-1].buffer_size
    return answer


def ingest_groups(store: RolloutStore, body: bytes, many: bool) -> bytes:
    """``POST /scored_data`` (``many=False``) and ``/scored_data_list`` (``many=True``)."""
    try:
        outcomes = store.ingest(parse_groups(body, many))
    except (BodyValidationError, GroupInconsistentError) as e:
        store.counters["rejected_invalid"] += 1
        logger.info("rejected a post: %s", e.message)
        raise
    except UnknownEnvError as e:
        store.counters["rejected_unknown_env"] += 1
        logger.info("rejected a post: %s", e.message)
        raise
    if many:
        return json.dumps(_list_answer(outcomes)).encode()
    outcome = outcomes[0]
    if outcome.status == "received":
        return RECEIVED
    return json.dumps({"status": "buffered", "buffer_size": outcome.buffer_size}).encode()


def serve_batch(store: RolloutStore, ack: str | None = None) -> bytes:
    """``GET /batch[?ack=ID]``: the oldest full batch as joined group JSON, or ``{"batch":null}``.

    ``ack`` is the client's last ``batch_id`` (None for clients that never send
    it); see :meth:`RolloutStore.serve_batch`.
    """
    if not store.registered:
        return json.dumps(NOT_REGISTERED).encode()
    return store.batch_answer(ack)


def status_env(store: RolloutStore, env_id: int) -> bytes:
    """``GET /status-env``: the env's throttling signal."""
    return json.dumps(store.env_status(env_id)).encode()
