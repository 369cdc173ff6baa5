"""The byte forms of the rollout API: how a group is stored and how answers are written.

A posted group is kept as its posted bytes (outer white space removed) plus the
``"field":null,`` bytes of the ``ScoredData`` fields it left out; its stored and
served form is the two joined (:func:`canonical_json`), so a trainer reads
every field the original served, while the store copies nothing per group.
The answers of the hot endpoints are written here as bytes, without a JSON
encoder on the common path.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Iterable, Sequence

from atroposlib.api.compression import unpack

__all__ = [
    "NO_BATCH",
    "NOT_REGISTERED",
    "RECEIVED",
    "batch_answer",
    "buffered_answer",
    "canonical_json",
    "list_answer",
    "missing_nulls",
    "posted_form",
    "stored_json",
]

RECEIVED = b'{"status":"received"}'
"""The answer to a group that went onto the queue."""
NO_BATCH = b'{"batch":null}'
"""``GET /batch`` when no full batch is queued."""
NOT_REGISTERED = json.dumps(
    {
        "status": "error",
        "message": "Trainer not registered. Call /register first.",
        "batch": [],
    }
).encode()
"""``GET /batch`` before ``/register`` (the original's answer)."""

_GROUP_FIELDS = (
    "tokens",
    "masks",
    "scores",
    "advantages",
    "ref_logprobs",
    "messages",
    "generation_params",
    "inference_logprobs",
    "overrides",
    "group_overrides",
    "images",
    "env_id",
    "distill_token_ids",
    "distill_logprobs",
)
"""The ``ScoredData`` fields in declaration order (a test keeps them equal to the model's)."""
_FIELD_NULLS = {name: b'"%s":null,' % name.encode() for name in _GROUP_FIELDS}
_missing_cache: Dict[frozenset, bytes] = {}


def canonical_json(body: bytes, fill: bytes) -> bytes:
    """The stored form of a posted group: its bytes with ``fill`` (the ``"field":null,``
    of its absent fields) inserted after the opening ``{``."""
    if not fill:
        return body
    return b"".join((b"{", fill, memoryview(body)[1:]))


def stored_json(body: bytes, fill: bytes, packed: bool, nbytes: int) -> bytes:
    """The JSON of a group held in memory: ``body`` is the posted bytes, or their LZ4
    block when ``packed`` (``nbytes`` is the JSON's length, ``fill`` included)."""
    raw = unpack(body, nbytes - len(fill)) if packed else body
    return canonical_json(raw, fill)


def missing_nulls(present: frozenset) -> bytes:
    """``"field":null,`` for every field absent from the posted group (cached per field set,
    so groups with the same fields share one ``bytes``)."""
    nulls = _missing_cache.get(present)
    if nulls is None:
        nulls = b"".join(v for k, v in _FIELD_NULLS.items() if k not in present)
        if len(_missing_cache) < 4096:
            _missing_cache[present] = nulls
    return nulls


def posted_form(raw: bytes, present: frozenset) -> tuple[bytes, bytes]:
    """The posted object's bytes (outer white space removed) and the ``"field":null,``
    bytes of its absent ``ScoredData`` fields (see :func:`canonical_json`); the bytes are
    not copied."""
    if raw[:1] != b"{" or raw[-1:] != b"}":
        raw = raw.strip()  # only JSON white space can surround it: validation passed
    return raw, missing_nulls(present)


def buffered_answer(buffer_size: int) -> bytes:
    """The answer to a group kept in its env's odd-size buffer."""
    return json.dumps({"status": "buffered", "buffer_size": buffer_size}).encode()


def list_answer(statuses: Sequence[tuple[str, int]]) -> bytes:
    """The ``/scored_data_list`` answer from each group's ``(status, buffer_size)``."""
    buffered = [size for status, size in statuses if status == "buffered"]
    answer: Dict[str, Any] = {"status": "received", "groups_processed": len(statuses)}
    if buffered:
        answer["buffered"] = len(buffered)
        answer["last_buffer_size"] = buffered[-1]
    return json.dumps(answer).encode()


def batch_answer(
    bodies: Iterable[bytes], batch_id: str, step: int, staleness: Dict[str, int] | None
) -> bytes:
    """``{"batch":[...],"batch_id":...,"step":...[,"staleness":{...}]}`` from the groups' JSON."""
    tail = b'],"batch_id":' + json.dumps(batch_id).encode() + b',"step":%d' % step
    if staleness is not None:
        tail += b',"staleness":' + json.dumps(staleness, separators=(",", ":")).encode()
    return b'{"batch":[' + b",".join(bodies) + tail + b"}"
