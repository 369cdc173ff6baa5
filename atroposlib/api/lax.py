"""Integral floats and boolean masks where the wire format has ints, taken as the original's
lax models took them.

The original's pydantic models ran in lax mode, so a token id or mask posted as ``1.0`` (as
numpy and torch float arrays serialise) was stored as the int ``1``, and a mask posted as
``true``/``false`` (a boolean array's ``tolist()``) as ``1``/``0``. The rollout API checks
groups strictly (see :mod:`atroposlib.api.decode`); a group that fails only because some int
fields hold integral floats, or ``masks`` holds booleans, is rewritten here with those values
as ints, then checked again, strictly. ``1.5``, ``NaN``, infinities, values out of range and
booleans anywhere but ``masks`` (a boolean token id is a bug, not a format) still fail, each
error naming its element. Only groups that already failed come here: the fast path is untouched.
"""

from __future__ import annotations

import json
import math
from typing import Any, Sequence

from pydantic import ValidationError

__all__ = ["integral_floats_as_ints"]

_INT_ERRORS = frozenset({"int_type", "int_from_float", "int_parsing"})
_BOOL_FIELDS = frozenset({"masks"})
"""Fields whose booleans are 0/1 (a mask is a 0/1 row; the original accepted ``true``)."""


def _fix(doc: Any, loc: Sequence[Any]) -> bool:
    """Replace the integral float (or mask boolean) at ``loc`` of ``doc`` with its int; False
    if it is not one."""
    parent: Any = doc
    try:
        for key in loc[:-1]:
            parent = parent[key]
        value = parent[loc[-1]]
    except (KeyError, IndexError, TypeError):
        return False
    if isinstance(value, bool):
        if loc[0] not in _BOOL_FIELDS:
            return False
        parent[loc[-1]] = int(value)
        return True
    if isinstance(value, int):
        return True  # already fixed (the same element reported twice)
    if not isinstance(value, float) or not math.isfinite(value) or not value.is_integer():
        return False
    parent[loc[-1]] = int(value)
    return True


def integral_floats_as_ints(raw: bytes, error: ValidationError) -> bytes | None:
    """``raw`` re-encoded with the integral floats that ``error`` found in int fields as
    ints, or None when any error of ``error`` is something else (the caller reports it)."""
    problems = error.errors(include_url=False, include_input=False)
    if not problems or any(p["type"] not in _INT_ERRORS for p in problems):
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    for problem in problems:
        loc = tuple(problem["loc"])
        if not loc or not _fix(doc, loc):
            return None
    return json.dumps(doc, separators=(",", ":"), allow_nan=True).encode()
