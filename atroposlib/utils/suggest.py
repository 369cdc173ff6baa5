""" "Did you mean ...?": the known names closest to a mistyped one.

One helper for every place that refuses an unknown name (the environment CLI's flags,
``atropos-grpo-run``'s YAML keys), so a typo gets the same kind of hint everywhere.
"""

from __future__ import annotations

import difflib
from typing import Iterable, List, Sequence

__all__ = ["closest", "did_you_mean"]


def closest(name: str, candidates: Sequence[str], cutoff: float = 0.6) -> List[str]:
    """The candidates nearly as similar to ``name`` as the best one (at most three), or none
    when even the best is less similar than ``cutoff`` (difflib's ratio, 0..1)."""
    scored = sorted(
        ((difflib.SequenceMatcher(None, name, c).ratio(), c) for c in candidates), reverse=True
    )
    if not scored or scored[0][0] < cutoff:
        return []
    best = scored[0][0]
    return [c for ratio, c in scored[:3] if ratio >= best - 0.04]


def did_you_mean(
    name: str, candidates: Iterable[str], cutoff: float = 0.6, prefix: str = ""
) -> str:
    """``"; did you mean group_size?"`` (or ``"... a or b?"``), or ``""`` when nothing is close;
    ``prefix`` is put before each suggestion (``"trainer."``, ``"--"``).

    >>> did_you_mean("grup_size", ["group_size", "model"])
    '; did you mean group_size?'
    """
    close = closest(name, sorted(candidates), cutoff)
    return f"; did you mean {' or '.join(prefix + c for c in close)}?" if close else ""
