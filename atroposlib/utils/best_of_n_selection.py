"""Pick the best of N candidates by a primary score, tie-broken by a secondary score."""

from __future__ import annotations

from typing import Sequence


def select_best_index(
    primary_scores: Sequence[float],
    secondary_scores: Sequence[float],
    primary_higher_is_better: bool = True,
    secondary_lower_is_better: bool = True,
) -> int:
    """Index of the best candidate.

    The primary score decides; among candidates tied on it, the secondary score
    decides (by default lower is better, e.g. a length); remaining ties go to the
    lowest index.

    Example::

        select_best_index([1.0, 1.0, 0.0], [30, 12, 5])  # -> 1

    Raises:
        ValueError: when the lists are empty or differ in length.
    """
    if len(primary_scores) == 0:
        raise ValueError("select_best_index: no candidates")
    if len(primary_scores) != len(secondary_scores):
        raise ValueError(
            f"select_best_index: {len(primary_scores)} primary scores but "
            f"{len(secondary_scores)} secondary scores"
        )
    p_sign = 1.0 if primary_higher_is_better else -1.0
    s_sign = -1.0 if secondary_lower_is_better else 1.0
    best = 0
    for i in range(1, len(primary_scores)):
        key_i = (p_sign * primary_scores[i], s_sign * secondary_scores[i])
        key_best = (p_sign * primary_scores[best], s_sign * secondary_scores[best])
        if key_i > key_best:
            best = i
    return best


__all__ = ["select_best_index"]
