"""Decoding of posted groups: one typed parse per group, exact bytes kept.

A group (``ScoredData``) is mostly thousands of numbers. Building a Python int
for each of them costs ~120 µs per 26 KiB group in any validator that does
(pydantic, msgspec and orjson alike). Here a group's bytes are
parsed once by simdjson (``pysimdjson``); every per-token row is checked and
measured from simdjson's document in C (``as_buffer``: every leaf must be an
int64, or a number for float fields), so no Python object is made per number.
What the store needs comes out of that pass: ``env_id``, the group size, the
length of every per-token row (for the length checks, docs/design.md,
"Per-token fields") and which fields are present.

``as_buffer`` flattens nested arrays, so a row such as ``[1, [2], 3]`` would
look like three ints. Once every leaf of the checked fields is known to be a
number, every ``[`` in the group's bytes is structural unless it sits in a
string, so the group is taken on the fast path only when the number of ``[``
bytes equals the number of arrays the fields should have (one per field plus
one per row). Strings containing ``[``, nested values in other fields,
duplicate keys, ``NaN``/``Infinity`` (which the original's json module accepts
and strict JSON parsers do not), ints beyond 64 bits and the rarer optional
fields (``messages``, ``distill_*``, ...) all take the other path: full strict
pydantic validation of the same bytes. That path also produces every 422's
FastAPI-shaped ``detail``; the fast path accepts a subset of what it accepts.

:func:`parse_groups` is the one entry: it returns each posted group's shape,
posted bytes and null fill, and words every type error as strict pydantic does.

``/scored_data_list`` bodies are parsed once, whole, by simdjson; when the
body's ``{``/``}`` bytes are exactly one pair per element (no nested objects,
no braces in strings: the common case), each element's span is where its pair
sits and it is checked from the same document (:func:`split_shapes`).
Otherwise the body is split into its elements' exact bytes by msgspec
(``list[msgspec.Raw]``), a validating JSON decoder that returns each element's
span of the input, and each element is decoded as above. Either way each group
is stored as posted, unknown keys included.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
from dataclasses import dataclass
from typing import Dict, List, Tuple

import msgspec
import numpy as np
import simdjson
from pydantic import ValidationError

from atroposlib.api.codec import posted_form
from atroposlib.api.errors import BodyValidationError, invalid_body
from atroposlib.api.lax import integral_floats_as_ints
from atroposlib.api.models import ScoredData, ScoredDataList

__all__ = [
    "FAST_FIELDS",
    "GroupShape",
    "ParsedGroup",
    "fast_shape",
    "model_shape",
    "parse_groups",
    "split_lenient",
    "split_list",
    "split_shapes",
    "version_of",
]

INT_ROWS = ("tokens", "masks")
FLOAT_ROWS = ("advantages", "ref_logprobs", "inference_logprobs")
FAST_FIELDS = frozenset((*INT_ROWS, *FLOAT_ROWS, "scores", "env_id"))
"""Fields the fast path checks itself; any other field of ``ScoredData`` must be absent or null."""
VERSION_ROWS = ("policy_version", "policy_version_max")
"""Optional per-sequence weight versions (not ``ScoredData`` fields: kept as posted); the
fast path reads the oldest for ``--max-staleness``."""

_MODEL_FIELDS = frozenset(ScoredData.model_fields)
_SLOW_FIELDS = _MODEL_FIELDS - FAST_FIELDS
_Array = simdjson.Array
_Object = simdjson.Object
_split_decoder = msgspec.json.Decoder(List[msgspec.Raw])
_local = threading.local()
_REUSE_MAX_BYTES = 1 << 20
"""Groups up to this size are parsed by a per-thread parser whose buffers are kept (a fresh
parser's allocations cost more than the parse); larger ones get a parser of their own, so one
huge post does not pin its buffers for the life of the process."""


def _parser() -> simdjson.Parser:
    """This thread's reusable parser (a document's proxies must be gone before the next parse)."""
    parser = getattr(_local, "parser", None)
    if parser is None:
        parser = _local.parser = simdjson.Parser()
    return parser


@dataclass(frozen=True)
class GroupShape:
    """What the store and the consistency checks need from one validated group.

    ``rows`` maps each per-token field that is present (not null) to the length
    of each of its rows; ``fields`` is the set of ``ScoredData`` fields present
    in the posted object (null ones included), for the stored canonical form.
    """

    env_id: int | None
    size: int
    scores: int
    rows: Dict[str, Tuple[int, ...]]
    fields: frozenset
    version: int | None = None
    max_id: int = -1
    """The largest id in ``tokens`` and ``distill_token_ids`` (-1: none), for the check
    against the trainer's ``vocab_size`` (:func:`~atroposlib.api.models.check_token_ids`)."""


_HIGH_BYTE = 7 if sys.byteorder == "little" else 0
"""Index of the most significant byte of a native uint64 (its top bit marks values >= 2^63)."""


def _leaves(value: object, of_type: str) -> Tuple[Tuple[int, ...], object] | None:
    """Row lengths and flat leaf buffer of a list of lists whose every leaf is ``of_type``
    (None: not provably so here).

    One ``as_buffer`` call checks every leaf of the field in C (``"i"``: int64,
    ``"d"``: any number, ``"u"``: token ids, 0..2^63-1: the uint64 pass refuses
    negatives and the top bit of each value's most significant byte, read by
    ``isascii``, finds 2^63 and above); it flattens, so the caller also proves
    that the rows hold no nested arrays.
    """
    if type(value) is not _Array:
        return None
    try:
        # A row that is a number has no len(); one that is a string or an object has a
        # non-number leaf, which as_buffer rejects.
        lengths = tuple(map(len, value))
        buf = value.as_buffer(of_type=of_type)
    except (TypeError, ValueError):
        return None
    if of_type == "u" and not bytes(buf)[_HIGH_BYTE::8].isascii():
        return None
    return lengths, buf


def _rows(value: object, of_type: str) -> Tuple[int, ...] | None:
    """Row lengths of a list of lists whose every leaf is ``of_type`` (see :func:`_leaves`)."""
    found = _leaves(value, of_type)
    return None if found is None else found[0]


def _id_rows(value: object) -> Tuple[Tuple[int, ...], int] | None:
    """Row lengths and largest id of a list of token-id rows (see :func:`_leaves`).

    The maximum is one C pass (numpy) over the ids ``as_buffer`` already laid out, so a
    trainer's ``vocab_size`` is checked without a second parse.
    """
    found = _leaves(value, "u")
    if found is None:
        return None
    ids = np.frombuffer(found[1], dtype=np.uint64)
    return found[0], int(ids.max()) if ids.size else -1


def _positions(data: bytes, byte: bytes, count: int) -> List[int] | None:
    """Where ``byte`` sits in ``data`` when it occurs exactly ``count`` times, else None.

    ``bytes.find`` runs at memchr speed and allocates nothing: several times faster than
    ``bytes.count`` for one byte, and than counting by ``replace`` once the data is large
    enough for its copy to need fresh pages."""
    found = []
    pos = -1
    for _ in range(count):
        pos = data.find(byte, pos + 1)
        if pos < 0:
            return None
        found.append(pos)
    return found if data.find(byte, pos + 1) < 0 else None


def fast_shape(raw: bytes) -> GroupShape | None:
    """The shape of ``raw`` when it is provably a valid ``ScoredData``; None sends it to pydantic.

    Never accepts what strict pydantic validation of the same bytes would
    reject (a property test checks this on generated bodies).
    """
    try:
        doc = _parser().parse(raw) if len(raw) <= _REUSE_MAX_BYTES else simdjson.Parser().parse(raw)
    except (ValueError, RuntimeError, TypeError):
        return None
    return _bracket_proven(raw, _unchecked_shape(doc))


def _bracket_proven(raw: bytes, found: Tuple[GroupShape, int] | None) -> GroupShape | None:
    """``found``'s shape when ``raw`` holds no ``[`` beyond its checked arrays, else None."""
    if found is None or _positions(raw, b"[", found[1]) is None:
        return None  # a nested array in a row, or '[' in a string or another field
    return found[0]


def _unchecked_shape(doc: object) -> Tuple[GroupShape, int] | None:
    """The shape of one parsed group and how many arrays its checked fields have, before
    the bracket count that proves its bytes hold no other ``[`` (:func:`_bracket_proven`)."""
    if type(doc) is not _Object:
        return None
    keys = list(doc.keys())
    present = set(keys)
    if len(keys) != len(present):
        return None  # duplicate keys: pydantic takes the last value, simdjson the first
    # ``doc.get`` of an absent key costs microseconds (a raised and caught error inside
    # pysimdjson): only present keys are looked up.
    found = _id_rows(doc.get("tokens") if "tokens" in present else None)
    if not found or not found[0]:
        return None  # absent, not ids, or empty (min_length=1): pydantic words the error
    tokens, max_id = found
    masks = _rows(doc.get("masks") if "masks" in present else None, "i")
    if masks is None:
        return None
    rows: Dict[str, Tuple[int, ...]] = {"tokens": tokens, "masks": masks}
    arrays = 2 + len(tokens) + len(masks)
    scores = doc.get("scores") if "scores" in present else None
    if type(scores) is not _Array:
        return None
    try:
        scores.as_buffer(of_type="d")
    except (TypeError, ValueError):
        return None
    arrays += 1
    for name in FLOAT_ROWS:
        value = doc.get(name) if name in present else None
        if value is None:
            continue
        lengths = _rows(value, "d")
        if lengths is None:
            return None
        rows[name] = lengths
        arrays += 1 + len(lengths)
    version = None
    for name in VERSION_ROWS:
        value = doc.get(name) if name in present else None
        if value is None:
            continue
        low = _min_int(value)
        if low is _NOT_INTS:
            return None
        arrays += 1
        if name == "policy_version":
            version = low
    env_id = doc.get("env_id") if "env_id" in present else None
    if env_id is not None and type(env_id) is not int:
        return None
    fields = _MODEL_FIELDS.intersection(present)
    for name in _SLOW_FIELDS & fields:
        if doc.get(name) is not None:
            return None
    return GroupShape(env_id, len(tokens), len(scores), rows, fields, version, max_id), arrays


_NOT_INTS = object()


def _min_int(value: object) -> object:
    """The smallest element of a simdjson array of int64 (None when empty), or ``_NOT_INTS``.

    Nested arrays flatten here; the caller's bracket count catches them.
    """
    if type(value) is not _Array:
        return _NOT_INTS
    try:
        buf = value.as_buffer(of_type="i")
    except (TypeError, ValueError):
        return _NOT_INTS
    ints = memoryview(buf).cast("B").cast("q")
    return min(ints) if len(ints) else None


def version_of(raw: bytes) -> int | None:
    """The oldest ``policy_version`` of a group that took the pydantic path (None when it has
    none, or not a flat list of ints: the field is optional and never refused)."""
    if b'"policy_version"' not in raw:
        return None
    try:
        doc = simdjson.Parser().parse(raw)
        value = doc.get("policy_version") if type(doc) is _Object else None
    except (ValueError, RuntimeError, TypeError):
        return None
    if value is None or type(value) is not _Array:
        return None
    if any(type(v) is not int for v in value):
        return None
    return min(value) if len(value) else None


def model_shape(group: ScoredData) -> GroupShape:
    """The shape of a group validated by pydantic (the slow path)."""
    rows = {
        name: tuple(len(r) for r in value)
        for name in (*INT_ROWS, *FLOAT_ROWS)
        if (value := getattr(group, name)) is not None
    }
    return GroupShape(
        group.env_id,
        len(group.tokens),
        len(group.scores),
        rows,
        frozenset(group.model_fields_set),
        max_id=_max_id(group),
    )


def _max_id(group: ScoredData) -> int:
    """The largest id of a validated group's ``tokens`` and ``distill_token_ids`` (-1: none)."""
    top = max((max(row) for row in group.tokens if row), default=-1)
    for seq in group.distill_token_ids or ():
        for pos in seq:
            if pos:
                top = max(top, max(pos))
    return top


def split_shapes(body: bytes) -> List[Tuple[bytes, GroupShape | None]] | None:
    """Each element's exact bytes and fast-path shape, from one simdjson parse of a whole list.

    Returns None (the caller splits with :func:`split_list` instead) unless
    ``body`` is a JSON array of objects and holds exactly as many ``{`` and
    ``}`` bytes as it has elements. Every object of the document puts one
    structural ``{`` and ``}`` in the bytes, so then no element nests an object
    and no string holds a brace: the k-th ``{`` opens element k and the k-th
    ``}`` closes it, and its span is exact. An element whose shape the fast path
    cannot prove comes back with shape None (strict pydantic decides).

    The bracket proof of :func:`fast_shape` is made once for the whole body when
    it can be: every element holds at least the ``[`` of its checked arrays, so
    when the body holds exactly one more (its own) than their sum, each holds
    exactly its own.
    """
    try:
        parser = _parser() if len(body) <= _REUSE_MAX_BYTES else simdjson.Parser()
        doc = parser.parse(body)
    except (ValueError, RuntimeError, TypeError):
        return None
    if type(doc) is not _Array:
        return None
    elements = list(doc)
    n = len(elements)
    if any(type(e) is not _Object for e in elements):
        return None
    opens = _positions(body, b"{", n)
    closes = _positions(body, b"}", n) if opens is not None else None
    if opens is None or closes is None:
        return None
    raws = [body[start : end + 1] for start, end in zip(opens, closes, strict=True)]
    found = [_unchecked_shape(element) for element in elements]
    shapes = [f for f in found if f is not None]
    total = 1 + sum(arrays for _, arrays in shapes)
    if len(shapes) == n and _positions(body, b"[", total) is not None:
        return [(raw, shape) for raw, (shape, _) in zip(raws, shapes, strict=True)]
    return [(raw, _bracket_proven(raw, f)) for raw, f in zip(raws, found, strict=True)]


def split_list(body: bytes) -> List[bytes] | None:
    """The exact bytes of each element of a JSON array (None when msgspec cannot parse ``body``).

    msgspec accepts strict JSON only; a body it rejects is validated by
    pydantic, and when pydantic accepts it (``NaN``/``Infinity``, which the
    original's json module reads) :func:`split_lenient` splits it.
    """
    try:
        return [bytes(r) for r in _split_decoder.decode(body)]
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None  # nesting deeper than msgspec recurses is not a group: pydantic words it


def split_lenient(body: bytes) -> List[bytes]:
    """Split a JSON array that Python's json module reads, with that module's parser.

    Each element's span comes from ``JSONDecoder.raw_decode`` (which reports
    where the value ended); only the whitespace and commas between elements
    are stepped over here.
    """
    text = body.decode("utf-8")
    decoder = json.JSONDecoder()
    ws = " \t\n\r"
    i = len(text) - len(text.lstrip(ws))
    if text[i : i + 1] != "[":
        raise ValueError("not a JSON array")
    i += 1
    out: List[bytes] = []
    while True:
        while text[i] in ws:
            i += 1
        if text[i] == "]" and not out:
            return out
        _, end = decoder.raw_decode(text, i)
        out.append(text[i:end].encode("utf-8"))
        i = end
        while text[i] in ws:
            i += 1
        if text[i] == "]":
            return out
        if text[i] != ",":
            raise ValueError(f"unexpected {text[i]!r} at {i}")
        i += 1


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
    bytes and the null fields its stored form adds (see :func:`~atroposlib.api.codec.posted_form`)."""

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
            raise invalid_body(e) from None
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
            raise invalid_body(e) from None
        try:  # every element's errors, located by index, as for the whole list
            ScoredDataList.validate_json(body)
        except ValidationError as whole:
            raise invalid_body(whole) from None
        raise invalid_body(
            e
        ) from None  # pragma: no cover - the list cannot pass when an element fails
    out = []
    for raw, shape in checked:
        posted, fill = posted_form(raw, shape.fields)
        out.append(ParsedGroup(shape, posted, fill))
    return out
