"""KL in the reward (``--kl-in-reward``, verl's ``use_kl_in_reward``).

Instead of a KL term in the loss, each sequence's score loses ``kl_coef`` times its
summed per-token KL to the reference (estimated from the policy's log-probs before the
batch's first update), and the group advantages are computed again from the shaped
scores, with the same ``--scale-rewards``. Sequences whose advantage did not come from
the scores (``set_advantage_to_zero``, env-supplied ``advantages``) keep theirs.

Example::

    apply_kl_in_reward(samples, prepared, kl_sums, kl_coef=0.05, scale_rewards="group")
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import numpy as np

from .data import Sample, group_advantages


def shaped_advantages(
    scores: Sequence[float],
    groups: Sequence[int],
    kl_sums: Sequence[float],
    kl_coef: float,
    scale_rewards: str,
) -> List[float]:
    """Per-sequence advantages of ``score − kl_coef·kl_sum``, grouped by ``groups``."""
    shaped = [s - kl_coef * k for s, k in zip(scores, kl_sums, strict=True)]
    batch_std = None
    if scale_rewards == "batch":
        batch_std = float(np.std(shaped, ddof=1)) if len(shaped) > 1 else 0.0
    members: Dict[int, List[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    out = [0.0] * len(shaped)
    for idx in members.values():
        for i, a in zip(
            idx,
            group_advantages([shaped[i] for i in idx], scale_rewards, batch_std),  # type: ignore[arg-type]
            strict=True,
        ):
            out[i] = a
    return out


def apply_kl_in_reward(
    samples: Sequence[Sample],
    prepared: Any,
    kl_sums: Sequence[float],
    kl_coef: float,
    scale_rewards: str,
) -> None:
    """Replace the score-derived advantages of ``samples`` (this rank's) by the shaped ones;
    ``kl_sums`` holds every sequence of the batch (by ``Sample.index``)."""
    adv = shaped_advantages(prepared.scores, prepared.groups, kl_sums, kl_coef, scale_rewards)
    for s in samples:
        if s.from_score:
            s.advantages = [adv[s.index]] * len(s.advantages)
