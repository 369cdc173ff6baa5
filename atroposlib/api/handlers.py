"""Request handling shared by the FastAPI routes and the raw-ASGI hot path.

Each function takes the store and raw inputs (body bytes, ids) and returns
the answer as JSON bytes; domain problems are raised as
:class:`~atroposlib.api.errors.ApiError`. Posted groups are validated once from
their JSON bytes (:mod:`~atroposlib.api.decode`) and kept as the posted bytes,
with absent fields added as nulls (see :func:`parse_groups`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import weakref
from dataclasses import dataclass
from typing import Any, List, Sequence, TypeVar

from pydantic import BaseModel, ValidationError

from atroposlib.api.decode import (
    GroupShape,
    fast_shape,
    model_shape,
    split_lenient,
    split_list,
    split_shapes,
    version_of,
)
from atroposlib.api.errors import (
    BodyValidationError,
    GroupInconsistentError,
    UnknownEnvError,
    validation_detail,
)
from atroposlib.api.lax import integral_floats_as_ints
from atroposlib.api.models import ScoredData, ScoredDataList, check_lengths
from atroposlib.api.store import IncomingGroup, IngestOutcome, RolloutStore

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

RECEIVED = b'{"status":"received"}'
NOT_REGISTERED = {
    "status": "error",
    "message": "Trainer not registered. Call /register first.",
    "batch": [],
}
_FIELD_NULLS = {name: b'"%s":null,' % name.encode() for name in ScoredData.model_fields}
_missing_cache: dict[frozenset, bytes] = {}
_warned: weakref.WeakKeyDictionary[RolloutStore, set] = weakref.WeakKeyDictionary()


def _missing_nulls(present: frozenset) -> bytes:
    """``"field":null,`` for every field absent from the posted group (cached per field set)."""
    nulls = _missing_cache.get(present)
    if nulls is None:
        nulls = b"".join(v for k, v in _FIELD_NULLS.items() if k not in present)
        if len(_missing_cache) < 4096:
            _missing_cache[present] = nulls
    return nulls


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


def _posted_form(raw: bytes, present: frozenset) -> tuple[bytes, bytes]:
    """The posted object's bytes (outer white space removed) and the ``"field":null,``
    bytes of its absent ``ScoredData`` fields, which the stored form inserts after
    its ``{`` (see :func:`atroposlib.api.queue.canonical_json`); the bytes are not copied."""
    if raw[:1] != b"{" or raw[-1:] != b"}":
        raw = raw.strip()  # only JSON white space can surround it: validation passed
    return raw, _missing_nulls(present)


def _shape(raw: bytes, shape: GroupShape | None = None) -> tuple[bytes, GroupShape]:
    """The bytes to store and the shape of one posted group: simdjson's single pass, or
    strict pydantic for the rest. A group that fails only by integral floats in int fields
    (``1.0``, as the original's lax models accepted) is stored with them as ints."""
    if shape is None:
        shape = fast_shape(raw)
    if shape is None:
        try:
            group = ScoredData.model_validate_json(raw)
        except ValidationError as e:
            fixed = integral_floats_as_ints(raw, e)
            if fixed is None:
                raise
            raw = fixed
            group = ScoredData.model_validate_json(raw)
        shape = model_shape(group)
        version = version_of(raw)
        if version is not None:
            shape = dataclasses.replace(shape, version=version)
    return raw, shape


@dataclass(frozen=True)
class ParsedGroup:
    """A type-valid posted group, before the consistency checks: its shape, its posted
    bytes and the null fields its stored form adds (see :func:`_posted_form`)."""

    shape: GroupShape
    body: bytes
    fill: bytes = b""


def _split(body: bytes) -> List[tuple[bytes, GroupShape | None]]:
    """A posted list's elements: exact bytes, and the fast path's shape where it has one."""
    pairs = split_shapes(body)
    if pairs is not None:
        return pairs
    raws = split_list(body)
    if raws is None:  # not strict JSON, or not an array: pydantic words it (or reads NaN)
        try:
            ScoredDataList.validate_json(body)
        except ValidationError as e:
            raise _invalid(e) from None
        try:
            raws = split_lenient(body)
        except (ValueError, IndexError, RecursionError) as e:  # pydantic read it, json not
            raise BodyValidationError(
                [{"type": "json_invalid", "loc": ["body"], "msg": f"Invalid JSON: {e}"}]
            ) from None
    return [(raw, None) for raw in raws]


def parse_groups(body: bytes, many: bool) -> List[ParsedGroup]:
    """Type-validate one group (or a list of groups) from the posted bytes, in one parse each.

    A list is parsed whole and cut into its elements' exact bytes (or split by
    msgspec first when the cut cannot be proven, see
    :func:`~atroposlib.api.decode.split_shapes`); each group is kept as posted,
    unknown keys included. Any type error is reported as strict pydantic
    reports it for the whole body (every error, FastAPI-shaped).
    """
    pairs = _split(body) if many else [(body, None)]
    try:
        checked = [_shape(raw, shape) for raw, shape in pairs]
    except ValidationError as e:
        if not many:
            raise _invalid(e) from None
        try:  # every element's errors, located by index, as for the whole list
            ScoredDataList.validate_json(body)
        except ValidationError as whole:
            raise _invalid(whole) from None
        raise _invalid(e) from None  # pragma: no cover - the list cannot pass when an element fails
    out = []
    for raw, shape in checked:
        posted, fill = _posted_form(raw, shape.fields)
        out.append(ParsedGroup(shape, posted, fill))
    return out


def incoming(
    parsed: Sequence[ParsedGroup], many: bool, strict: bool
) -> tuple[List[IncomingGroup], List[tuple[int | None, str]]]:
    """Check each group's counts and lengths (D5/D17); the groups to store and the lenient findings.

    The findings are ``(env_id, field)`` for optional per-token fields whose
    lengths disagree with ``tokens`` (accepted unless ``strict``).
    """
    out: List[IncomingGroup] = []
    findings: List[tuple[int | None, str]] = []
    for i, p in enumerate(parsed):
        loc = (i,) if many else ()
        for name in check_lengths(p.shape.rows, p.shape.scores, loc, strict):
            findings.append((p.shape.env_id, name))
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


def _note_inconsistent(store: RolloutStore, findings: Sequence[tuple[int | None, str]]) -> None:
    """Count accepted groups with mismatched optional fields; warn once per env and field."""
    warned = _warned.setdefault(store, set())
    for env_id, name in findings:
        key = f"inconsistent_{name}"
        store.counters[key] = store.counters.get(key, 0) + 1
        if (env_id, name) not in warned:
            warned.add((env_id, name))
            logger.warning(
                "env %s sent %s whose lengths differ from tokens; accepted as the original API "
                "does (counted in atropos_inconsistent_groups_total; run-api --strict-groups "
                "rejects such groups with 422). Further ones from this env are only counted.",
                "without env_id" if env_id is None else env_id,
                name,
            )


def _list_answer(outcomes: Sequence[IngestOutcome]) -> dict[str, Any]:
    buffered = [o for o in outcomes if o.status == "buffered"]
    answer: dict[str, Any] = {"status": "received", "groups_processed": len(outcomes)}
    if buffered:
        answer["buffered"] = len(buffered)
        answer["last_buffer_size"] = buffered[-1].buffer_size
    return answer


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
    from ``tokens``; otherwise they are accepted, warned about and counted (D17).
    ``defer`` leaves the database commit to the caller (see :meth:`RolloutStore.ingest`).
    """
    if strict is None:
        strict = getattr(store, "strict_groups", False)
    try:
        groups, findings = incoming(parse_groups(body, many), many, strict)
        outcomes = store.ingest(groups, defer=defer)
    except (BodyValidationError, GroupInconsistentError) as e:
        store.counters["rejected_invalid"] += 1
        logger.info("rejected a post: %s", e.message)
        raise
    except UnknownEnvError as e:
        store.counters["rejected_unknown_env"] += 1
        logger.info("rejected a post: %s", e.message)
        raise
    if findings:
        _note_inconsistent(store, findings)
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
