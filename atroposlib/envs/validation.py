"""Check and normalise a scored group before it is written to disk or sent (ScoredData rules).

Environments build groups by hand, and what a tokenizer returns changes between
library versions: under transformers 5 ``apply_chat_template(..., tokenize=True)``
gives a ``BatchEncoding``, not a list. Rather than writing such a value as text
(or letting the rollout API refuse it), :func:`normalize_group` converts what has
one obvious meaning and refuses the rest with an :class:`InvalidGroupError` that
names the field:

- a ``BatchEncoding`` or any mapping with ``input_ids``, numpy arrays and torch
  tensors of integers (1-D, or 2-D with one row) become lists of ``int``;
- float sequences (``scores``, ``advantages``, logprobs) become lists of ``float``;
- ``tokens``, ``masks`` and ``scores`` must have one entry per sequence, and each
  sequence's ``masks`` as many entries as its ``tokens`` (the rollout API checks
  the same and answers 422 otherwise);
- every other field must be JSON as it is: nothing is turned into a string.

Example::

    group = normalize_group({"tokens": [np.array([1, 2])], "masks": [[-100, 2]], "scores": [1]})
    group["tokens"]  # [[1, 2]]
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from itertools import chain
from numbers import Integral, Real
from typing import Any, Dict, List

PER_TOKEN_FLOAT_FIELDS = ("advantages", "ref_logprobs", "inference_logprobs")
CHECKED_FIELDS = frozenset(
    ("tokens", "masks", "scores", "distill_token_ids", "distill_logprobs", *PER_TOKEN_FLOAT_FIELDS)
)


class InvalidGroupError(ValueError):
    """A group that breaks the ScoredData rules; ``field`` names the offending key."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


def _dtype_kind(value: Any) -> str | None:
    """``"int"``, ``"float"`` or ``"other"`` for numpy arrays and torch tensors; None otherwise."""
    dtype = getattr(value, "dtype", None)
    if dtype is None or not hasattr(value, "tolist"):
        return None
    name = str(dtype)
    if "int" in name:
        return "int"
    if "float" in name or "bfloat" in name:
        return "float"
    return "other"


def _as_list(value: Any, field: str, index: int, want: str) -> List[Any]:
    """One sequence as a plain list (``want`` is ``"int"`` or ``"float"``)."""
    if type(value) is not list:  # a plain list (nearly every sequence) needs no conversion
        value = _to_list(value, f"{field}[{index}]", want)
    if len(value) == 1 and isinstance(value[0], (list, tuple)):
        value = list(value[0])  # a batch of one sequence, e.g. return_tensors="pt"
    return _check_items(value, field, index, want)


def _to_list(value: Any, where: str, want: str) -> List[Any]:
    """A sequence that is not a plain list (mapping, array, tensor, tuple) as one."""
    if isinstance(value, Mapping):
        if "input_ids" not in value:
            raise InvalidGroupError(
                where, f"a mapping without 'input_ids' (keys: {sorted(map(str, value))[:5]})"
            )
        value = value["input_ids"]
    kind = _dtype_kind(value)
    if kind is not None:
        if kind == "other" or (want == "int" and kind != "int"):
            raise InvalidGroupError(where, f"an array of {value.dtype}, expected {want}s")
        value = value.tolist()
    elif isinstance(value, tuple):
        value = list(value)
    if not isinstance(value, list):
        raise InvalidGroupError(where, f"expected a list of {want}s, got {type(value).__name__}")
    return value


_INT_ONLY = frozenset((int,))
_FLOAT_ONLY = frozenset((float,))


def _check_items(seq: List[Any], field: str, index: int | None, want: str) -> List[Any]:
    """``seq`` with every item an ``int`` (``want="int"``) or a ``float``; errors name
    ``field[index]`` (``field`` alone when ``index`` is None)."""
    types = set(map(type, seq))
    if want == "int":
        if types <= _INT_ONLY:
            return seq
        where = field if index is None else f"{field}[{index}]"
        for i, v in enumerate(seq):
            if isinstance(v, bool) or not isinstance(v, Integral):
                raise InvalidGroupError(f"{where}[{i}]", f"expected an int, got {v!r}")
        return [int(v) for v in seq]
    if types <= _FLOAT_ONLY:
        return seq
    where = field if index is None else f"{field}[{index}]"
    for i, v in enumerate(seq):
        if isinstance(v, bool) or not isinstance(v, Real):
            raise InvalidGroupError(f"{where}[{i}]", f"expected a number, got {v!r}")
    return [float(v) for v in seq]


def _sequences(group: Mapping[str, Any], field: str, want: str) -> List[List[Any]]:
    value = group.get(field)
    if type(value) is not list:
        value = _outer_list(value)
    if not isinstance(value, list):
        raise InvalidGroupError(field, f"expected a list of sequences, got {type(value).__name__}")
    return [_as_list(seq, field, i, want) for i, seq in enumerate(value)]


def _outer_list(value: Any) -> Any:
    """The sequences of a field given as an array, a tensor, a mapping or a tuple, as a list
    (anything else is returned as it is, for the caller to refuse)."""
    if _dtype_kind(value) is not None:
        value = value.tolist()
    if isinstance(value, Mapping) and "input_ids" in value:
        value = value["input_ids"]
    if isinstance(value, tuple):
        value = list(value)
    return value


def _scores(value: Any) -> List[float]:
    if _dtype_kind(value) is not None:
        value = value.tolist()
    if isinstance(value, tuple):
        value = list(value)
    if not isinstance(value, list):
        raise InvalidGroupError("scores", f"expected a list of numbers, got {type(value).__name__}")
    out = _check_items(value, "scores", None, "float")
    for i, v in enumerate(out):
        if not math.isfinite(v):
            raise InvalidGroupError(f"scores[{i}]", f"not a finite number ({v})")
    return out


_PLAIN_SCALARS = frozenset((str, int, bool, type(None)))
_LIST_ONLY = frozenset((list,))
_PLAIN_MAX_DEPTH = 64


def is_plain_json(value: Any, _depth: int = 0) -> bool:
    """True when ``value`` is built only of dicts with ``str`` keys, lists, ``str``, ``int``,
    ``bool``, ``None`` and finite floats (exact types, nested at most 64 deep).

    Such a value is JSON with one meaning: ``json.dumps(value, allow_nan=False)`` encodes it,
    and every encoder writes the same JSON value for it. False means "look closer" (a
    subclass, a tuple, a NaN, deep nesting), not "invalid".

    >>> is_plain_json({"a": [1, 2.5, None]}), is_plain_json({"a": float("nan")})
    (True, False)
    """
    if _depth > _PLAIN_MAX_DEPTH:
        return False
    kind = type(value)
    if kind is list:
        # Token lists: one pass in C over the item types, no Python call per item; a list
        # of such lists (a group's tokens or masks) in one pass over all their items.
        types = set(map(type, value))
        if types <= _PLAIN_SCALARS:
            return True
        if types == _FLOAT_ONLY:  # scores, logprobs
            return all(map(math.isfinite, value))
        if types == _LIST_ONLY and set(map(type, chain.from_iterable(value))) <= _PLAIN_SCALARS:
            return True
        return all(type(v) in _PLAIN_SCALARS or is_plain_json(v, _depth + 1) for v in value)
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str:
                return False
            if type(item) not in _PLAIN_SCALARS and not is_plain_json(item, _depth + 1):
                return False
        return True
    if kind is float:
        return math.isfinite(value)
    return kind in _PLAIN_SCALARS


def _check_json(field: str, value: Any) -> None:
    if is_plain_json(value):  # encodable as it is: skip building the text
        return
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise InvalidGroupError(field, f"not JSON-serializable ({err})") from None


def _check_messages(value: Any) -> None:
    if not isinstance(value, list):
        raise InvalidGroupError("messages", f"expected a list, got {type(value).__name__}")
    for i, conversation in enumerate(value):
        if not isinstance(conversation, list):
            raise InvalidGroupError(
                f"messages[{i}]", f"expected a list of messages, got {type(conversation).__name__}"
            )
        for j, message in enumerate(conversation):
            if (
                not isinstance(message, Mapping)
                or "role" not in message
                or "content" not in message
            ):
                raise InvalidGroupError(
                    f"messages[{i}][{j}]", "each message needs 'role' and 'content'"
                )


def normalize_group(group: Mapping[str, Any]) -> Dict[str, Any]:
    """Return ``group`` with its token/score fields as plain lists; raise if it breaks the rules.

    The returned dict is ``group`` itself when it is a ``dict`` (fields are
    replaced in place), so references the environment holds see the same data.
    """
    if not isinstance(group, Mapping):
        raise InvalidGroupError("group", f"expected a dict, got {type(group).__name__}")
    out = group if isinstance(group, dict) else dict(group)
    for field in ("tokens", "masks", "scores"):
        if out.get(field) is None:
            raise InvalidGroupError(field, "missing")
    tokens = _sequences(out, "tokens", "int")
    masks = _sequences(out, "masks", "int")
    scores = _scores(out["scores"])
    n = len(tokens)
    if len(masks) != n:
        raise InvalidGroupError("masks", f"{len(masks)} sequences for {n} token sequences")
    if len(scores) != n:
        raise InvalidGroupError("scores", f"{len(scores)} scores for {n} token sequences")
    for i, (t, m) in enumerate(zip(tokens, masks, strict=True)):
        if len(t) != len(m):
            raise InvalidGroupError(f"masks[{i}]", f"{len(m)} entries for {len(t)} tokens")
    out["tokens"], out["masks"], out["scores"] = tokens, masks, scores
    for field in PER_TOKEN_FLOAT_FIELDS:
        if out.get(field) is not None:
            values = _sequences(out, field, "float")
            if len(values) != n:
                raise InvalidGroupError(field, f"{len(values)} sequences for {n} token sequences")
            out[field] = values
    for field, want in (("distill_token_ids", "int"), ("distill_logprobs", "float")):
        if out.get(field) is not None:
            out[field] = _nested(out[field], field, want)
    if out.get("messages") is not None:
        _check_messages(out["messages"])
    for field, value in out.items():
        if field not in CHECKED_FIELDS and value is not None:
            _check_json(field, value)
    return out


def _nested(value: Any, field: str, want: str) -> List[List[List[Any]]]:
    """``[seq][pos][k]`` values (teacher top-k ids or logprobs) as plain lists."""
    if _dtype_kind(value) is not None:
        value = value.tolist()
    if not isinstance(value, list):
        raise InvalidGroupError(field, f"expected [seq][pos][k] lists, got {type(value).__name__}")
    out = []
    for i, seq in enumerate(value):
        if _dtype_kind(seq) is not None:
            seq = seq.tolist()
        if not isinstance(seq, list):
            raise InvalidGroupError(f"{field}[{i}]", f"expected a list, got {type(seq).__name__}")
        out.append([_as_list(pos, f"{field}[{i}]", j, want) for j, pos in enumerate(seq)])
    return out


__all__ = ["InvalidGroupError", "is_plain_json", "normalize_group"]
