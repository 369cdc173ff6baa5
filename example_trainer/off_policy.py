"""Off-policy correction: importance weights between the trainer's and the sampler's policy.

Rollouts are sampled by the inference server with weights that may be several steps
old (async RL) and, even when fresh, with different numerics than the trainer. Their
``inference_logprobs`` ``b`` therefore differ from the trainer's log-probs ``p`` of the
same tokens. ``atropos-grpo --off-policy-correction`` picks what to do about it:

- ``none`` (the default, as the original): the GRPO ratio is taken against ``b``
  directly (see :mod:`.training`), nothing else;
- ``tis`` (truncated importance sampling): the policy-gradient term of each token is
  taken on-policy w.r.t. the trainer (ratio against its own detached log-probs) and
  weighted by ``w = min(exp(p - b), C)``, ``C = --off-policy-clip`` (default 2.0);
  ``w`` carries no gradient, so large ratios cannot blow up the update;
- ``icepop``: the same, but tokens whose ratio falls outside
  ``[--off-policy-clip-low, --off-policy-clip]`` (default ``[0.5, 2.0]``) are masked out
  (weight 0) instead of truncated, and the rest keep weight ``exp(p - b)``.

Per step the trainer logs ``off_policy/mean_ratio`` (mean of ``exp(p - b)`` over label
tokens), ``off_policy/clip_fraction`` (share of tokens truncated or masked) and
``off_policy/mismatch_kl`` (the k3 estimate of KL(sampler ‖ trainer),
``mean(r - 1 - log r)`` with ``r = exp(p - b)``; 0 when the two agree), and, when the
batch's groups carry ``policy_version``, ``off_policy/staleness_max``/``_mean`` (versions
behind the weights being trained).

Example::

    w, stats = correction_weights(p, b, mask, "tis", clip=2.0)
    loss = -(w * surrogate * mask).sum() / mask.sum()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Sequence

import torch

MODES = ("none", "tis", "icepop")

_MAX_LOG_RATIO = 20.0
"""Log-ratios are clamped to this before exponentiating: a token the sampler found
astronomically unlikely must give a large but finite ratio (it is truncated or masked
anyway)."""


@dataclass(frozen=True)
class CorrectionConfig:
    """What ``--off-policy-correction`` and its clip flags chose."""

    mode: str = "none"
    clip: float = 2.0
    clip_low: float = 0.5

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"off-policy correction {self.mode!r} is not one of {MODES}")
        if self.clip <= 0 or self.clip_low < 0 or self.clip_low > self.clip:
            raise ValueError("need 0 <= off_policy_clip_low <= off_policy_clip and clip > 0")

    @property
    def active(self) -> bool:
        """Whether a correction is applied at all."""
        return self.mode != "none"


def correction_weights(
    trainer_logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip: float = 2.0,
    clip_low: float = 0.5,
) -> tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Per-token importance weights (detached, 0 off the mask) and their statistics.

    ``trainer_logprobs`` ``p``, ``inference_logprobs`` ``b`` and ``mask`` (1 on label
    tokens) share a shape. ``mode`` is ``none`` (weights 1), ``tis`` or ``icepop``.
    The statistics are 0-d tensors: ``mean_ratio``, ``clip_fraction``, ``mismatch_kl``.
    """
    if mode not in MODES:
        raise ValueError(f"off-policy correction {mode!r} is not one of {MODES}")
    mask = mask.to(torch.float32)
    log_ratio = ((trainer_logprobs.detach().float() - inference_logprobs.float()) * mask).clamp(
        -_MAX_LOG_RATIO, _MAX_LOG_RATIO
    )
    ratio = torch.exp(log_ratio)
    if mode == "tis":
        clipped = (ratio > clip).float() * mask
        weights = ratio.clamp(max=clip)
    elif mode == "icepop":
        outside = (ratio > clip) | (ratio < clip_low)
        clipped = outside.float() * mask
        weights = torch.where(outside, torch.zeros_like(ratio), ratio)
    else:
        clipped = torch.zeros_like(ratio)
        weights = torch.ones_like(ratio)
    weights = weights * mask
    n = mask.sum().clamp(min=1.0)
    # expm1 in float64: r - 1 - log r cancels to 0 in float32 for the ~1e-6 gaps typical
    # between a trainer and a sampler with the same weights.
    x = log_ratio.double()
    k3 = ((torch.expm1(x) - x) * mask).float()
    stats = {
        "mean_ratio": (ratio * mask).sum() / n,
        "clip_fraction": clipped.sum() / n,
        "mismatch_kl": k3.sum() / n,
    }
    return weights.detach(), stats


def policy_version_summary(batch: Sequence[Mapping[str, Any]]) -> Dict[str, float]:
    """Oldest and mean ``policy_version`` of a batch's sequences (empty when none has one)."""
    versions = [
        v
        for group in batch
        for v in (group.get("policy_version") or [])
        if isinstance(v, int) and not isinstance(v, bool)
    ]
    if not versions:
        return {}
    return {
        "off_policy/policy_version_min": float(min(versions)),
        "off_policy/policy_version_mean": sum(versions) / len(versions),
    }


def staleness_metrics(summary: Mapping[str, float], trained_version: int) -> Dict[str, float]:
    """How many versions behind the weights being trained (``trained_version``: the steps
    taken before this one) the batch's samples are: ``off_policy/staleness_max`` and
    ``_mean``; empty when the batch carried no versions."""
    if "off_policy/policy_version_min" not in summary:
        return {}
    return {
        "off_policy/staleness_max": trained_version - summary["off_policy/policy_version_min"],
        "off_policy/staleness_mean": trained_version - summary["off_policy/policy_version_mean"],
    }
