"""Off-policy correction: the PPO surrogate against the sampler, with its ratio truncated or masked.

Rollouts are sampled by the inference server with weights that may be several steps
old (async RL) and, even when fresh, with different numerics than the trainer. Their
``inference_logprobs`` ``b`` therefore differ from the trainer's log-probs ``p`` of the
same tokens. Every mode takes the importance ratio ``r = exp(p - b)`` against the
sampler and keeps PPO's clip around it (the trust region: a token already moved beyond
``1 ± eps`` in the direction its advantage pushes gets no gradient); the trainer takes
one optimizer step per batch, so a ratio against its own log-probs would be identically
1 and clip nothing. ``atropos-grpo --off-policy-correction`` picks what happens to the
tokens PPO's clip leaves alone:

- ``none`` (the default, as the original): ``min(r·A, clip(r, 1-eps, 1+eps)·A)``
  (see :mod:`.training`); a token with ``A < 0`` and a huge ``r`` (the sampler found it
  unlikely, the trainer likes it) gets a gradient ``r·A·∇p``, unbounded;
- ``tis`` (truncated importance sampling): the same surrogate with the ratio's weight
  truncated at ``C = --off-policy-clip`` (default 2.0): a token PPO leaves active gets
  ``min(r, C)·A·∇p``, so the ``A < 0`` tail is bounded by ``C·|A|`` (like dual-clip PPO,
  but keeping a bounded gradient instead of none); the trust region is decided on the
  untruncated ``r``, so a ``C`` below ``1 + eps`` truncates more without opening it.
  For ``C >= 1 + eps`` this is exactly ``min(r_C·A, clip(r_C, 1-eps, 1+eps)·A)`` with
  ``r_C = min(r, C)`` as a value whose gradient is ``r_C·∇p``;
- ``icepop``: tokens whose ``r`` lies outside ``[--off-policy-clip-low, --off-policy-clip]``
  (default ``[0.5, 2.0]``) are masked out (no loss, no gradient); the rest get the
  ``none`` surrogate.

Per step the trainer logs ``off_policy/mean_ratio`` (mean of ``r`` over label tokens),
``off_policy/clip_fraction`` (share of tokens whose ratio ``tis`` truncated or ``icepop``
masked) and ``off_policy/mismatch_kl`` (the k3 estimate of KL(sampler ‖ trainer),
``mean(r - 1 - log r)``; 0 when the two agree), and, when the batch's groups carry
``policy_version``, ``off_policy/staleness_max``/``_mean`` (versions behind the weights
being trained).

Example::

    surrogate, ratio, stats = corrected_surrogate(p, b, adv, mask, 0.2, CorrectionConfig("tis"))
    loss = -(surrogate * mask).sum() / mask.sum()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Sequence

import torch

MODES = ("none", "tis", "icepop")
TIS_MODES = ("clip-zone-zero", "truncate")

MAX_LOG_RATIO = 20.0
"""Log-ratios are clamped to this before exponentiating: a token the sampler found
astronomically unlikely must give a large but finite ratio (it is truncated or masked
anyway)."""


@dataclass(frozen=True)
class CorrectionConfig:
    """What ``--off-policy-correction`` and its clip flags chose."""

    mode: str = "none"
    clip: float = 2.0
    clip_low: float = 0.5
    tis_mode: str = "clip-zone-zero"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"off-policy correction {self.mode!r} is not one of {MODES}")
        if self.tis_mode not in TIS_MODES:
            raise ValueError(f"tis_mode {self.tis_mode!r} is not one of {TIS_MODES}")
        if self.clip <= 0 or self.clip_low < 0 or self.clip_low > self.clip:
            raise ValueError("need 0 <= off_policy_clip_low <= off_policy_clip and clip > 0")

    @property
    def active(self) -> bool:
        """Whether a correction is applied at all."""
        return self.mode != "none"

    @property
    def truncate(self) -> bool:
        """``tis`` in TRL's and verl's form (``--tis-mode truncate``)."""
        return self.mode == "tis" and self.tis_mode == "truncate"


def truncated_weights(
    old_logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    present: torch.Tensor,
    clip: float,
    trainer_logprobs: torch.Tensor,
) -> tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """``--tis-mode truncate`` (TRL's ``vllm_importance_sampling_correction``, verl's
    ``rollout_is`` in truncate mode): each token's loss is multiplied by the constant
    ``w = min(exp(old − b), C)``, ``old`` the trainer's log-prob before the batch's first
    update and ``b`` the sampler's; PPO's clipped ratio is then taken against ``old``, so
    a token in the clip zone keeps the weighted gradient ``min(r, C)·A·∇p`` instead of 0.
    ``w`` is 1 on tokens without a sampler log-prob (``present`` false). Returns ``w``
    and the statistics of :func:`corrected_surrogate` (ratios of the current policy
    ``trainer_logprobs`` to the sampler)."""
    mask = present.to(old_logprobs.dtype)
    gap = ((old_logprobs - inference_logprobs.to(old_logprobs.dtype)) * mask).clamp(
        -MAX_LOG_RATIO, MAX_LOG_RATIO
    )
    raw = torch.exp(gap).detach()
    weights = torch.where(present, raw.clamp(max=clip), torch.ones_like(raw))
    log_ratio = ((trainer_logprobs - inference_logprobs.to(trainer_logprobs.dtype)) * mask).clamp(
        -MAX_LOG_RATIO, MAX_LOG_RATIO
    )
    changed = (raw > clip).to(mask.dtype) * mask
    return weights, _mismatch_stats(log_ratio.detach(), mask, changed)


def corrected_surrogate(
    trainer_logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    config: CorrectionConfig,
    clip_eps_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
    """Per-token PPO surrogate (to maximise) against the sampler under ``config``'s correction.

    ``trainer_logprobs`` ``p`` (carrying the gradient), ``inference_logprobs`` ``b``,
    ``advantages`` ``A`` and ``mask`` (1 on label tokens) share a shape. Returns the
    surrogate (0 off the mask and, for ``icepop``, on masked tokens), the untruncated
    ratio ``r = exp(p - b)`` (for logging; 1 off the mask) and the statistics
    ``mean_ratio``, ``clip_fraction``, ``mismatch_kl`` (0-d tensors). See the module
    docstring for the formulas. ``clip_eps_high`` (default ``clip_eps``) is the upper
    side of the band, ``1 + clip_eps_high``.
    """
    high = clip_eps if clip_eps_high is None else clip_eps_high
    mode = config.mode
    mask = mask.to(trainer_logprobs.dtype)
    log_ratio = ((trainer_logprobs - inference_logprobs.to(trainer_logprobs.dtype)) * mask).clamp(
        -MAX_LOG_RATIO, MAX_LOG_RATIO
    )
    ratio = torch.exp(log_ratio)
    r = ratio.detach()
    clipped_ratio = ratio.clamp(1.0 - clip_eps, 1.0 + high)
    if mode == "tis":
        # PPO's min picks the clipped (constant) branch exactly for these tokens.
        outside = ((advantages > 0) & (r > 1.0 + high)) | ((advantages < 0) & (r < 1.0 - clip_eps))
        # Value min(r, C), gradient min(r, C)·∇p.
        truncated = r.clamp(max=config.clip) * torch.exp(
            trainer_logprobs - trainer_logprobs.detach()
        )
        surrogate = torch.where(
            outside, clipped_ratio.detach() * advantages, truncated * advantages
        )
        changed = (r > config.clip).to(mask.dtype) * mask
    else:
        surrogate = torch.min(ratio * advantages, clipped_ratio * advantages)
        changed = torch.zeros_like(mask)
        if mode == "icepop":
            changed = ((r > config.clip) | (r < config.clip_low)).to(mask.dtype) * mask
            surrogate = surrogate * (1.0 - changed)
    surrogate = surrogate * mask
    return surrogate, ratio, _mismatch_stats(log_ratio.detach(), mask, changed)


def _mismatch_stats(
    log_ratio: torch.Tensor, mask: torch.Tensor, changed: torch.Tensor
) -> Dict[str, torch.Tensor]:
    n = mask.sum().clamp(min=1.0)
    # expm1 in float64: r - 1 - log r cancels to 0 in float32 for the ~1e-6 gaps typical
    # between a trainer and a sampler with the same weights.
    x = log_ratio.double()
    k3 = ((torch.expm1(x) - x) * mask).float()
    return {
        "mean_ratio": (torch.exp(log_ratio).float() * mask).sum() / n,
        "clip_fraction": changed.sum() / n,
        "mismatch_kl": k3.sum() / n,
    }


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
