"""The GRPO loss over per-token log-probs: objective, regularisers, aggregation, metrics.

:func:`compute_loss` takes what a trainer has once the forward pass is done: the current
policy's log-prob of every label token (carrying the gradient), the sampler's and the
trainer's old log-probs, the reference's, the advantages and the mask of label tokens,
plus a :class:`~example_trainer.loss_config.LossConfig`. It returns the scalar to
backpropagate and detached statistics. Terms that need the logits themselves (the
entropy bonus, the teacher's top-k divergence) come in as per-token tensors, so this
module never sees a vocabulary. :func:`~example_trainer.training.grpo_loss` is the
logits form on top of it.

The loss per token ``l`` is the negated policy objective plus the regularisers:

- objective: ``min(r·A, clip(r, 1−ε_low, 1+ε_high)·A)``, ``r = exp(clamp(logp − b, ±20))``
  against the sampler's log-prob ``b`` (the trainer's own, detached, where the sampler sent
  none: ``r = 1``); with ``--off-policy-correction`` the ``tis``/``icepop`` surrogate of
  :mod:`.off_policy`; GSPO's sequence-level ratio with ``importance_sampling_level
  sequence``; dual-clip's cap ``−c·A`` for ``A < 0`` with ``clip_ratio_c``;
- regularisers: ``+ kl_coef·KL`` (:mod:`.kl`), ``− entropy_coef·H``, ``+ distill_coef·D``
  (``distill_only`` keeps ``D`` alone);
- aggregation by ``loss_type`` over the optimizer step's label tokens and sequences.

Nothing here reads a value back to the host: the statistics are 0-d tensors on the
inputs' device.

Example::

    out = compute_loss(logp, inference_lp, adv, labels != -100, LossConfig(kl_coef=0.05),
                       ref_logprobs=ref_lp)
    out.loss.backward()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

import torch

from .kl import kl_penalty
from .loss_config import LossConfig
from .off_policy import MAX_LOG_RATIO, corrected_surrogate, truncated_weights

MAX_SEQ_LOG_RATIO = 10.0
"""GSPO's per-token log-ratio is capped at this (verl's value)."""

Stats = Dict[str, torch.Tensor]


@dataclass
class LossOutput:
    """The scalar loss to backpropagate plus detached statistics (0-d tensors) for logging."""

    loss: torch.Tensor
    metrics: Dict[str, torch.Tensor]


@dataclass
class _Objective:
    """The policy-gradient part of one micro-batch, and what its metrics read."""

    surrogate: torch.Tensor  # per token, to maximise
    ratio: torch.Tensor  # the ratio it was taken with (to the sampler where corrected)
    present: torch.Tensor  # bool: tokens with a sampler log-prob
    sampler_lp: torch.Tensor  # the sampler's log-prob, the trainer's where absent
    is_stats: Stats | None  # off-policy statistics, when a correction ran


def sampler_mask(inference_logprobs: torch.Tensor) -> torch.Tensor:
    """Tokens whose ``inference_logprobs`` entry is a log-prob (finite and <= 0), not the
    1.0 "not generated" marker."""
    return torch.isfinite(inference_logprobs) & (inference_logprobs <= 0)


def compute_loss(
    logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    config: LossConfig | None = None,
    *,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    inference_mask: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    distill: torch.Tensor | None = None,
    distill_mask: torch.Tensor | None = None,
    normalizer: float | None = None,
    num_sequences: int | None = None,
    max_tokens: int | None = None,
) -> LossOutput:
    """GRPO loss of one micro-batch from per-token log-probs (see the module docstring).

    ``logprobs`` ``[B, T]`` (0 off the mask) carries the gradient; ``loss_mask`` (bool
    ``[B, T]``) marks label tokens; ``advantages`` is ``[B, T]`` or ``[B]`` (broadcast).
    ``inference_logprobs`` are the sampler's (``inference_mask`` marks the tokens that have
    one; default :func:`sampler_mask`); ``old_logprobs`` the trainer's before the batch's
    first update (default: ``logprobs``, detached); ``ref_logprobs`` the KL anchor (logged
    as ``train/kl`` even at weight 0). ``entropy`` (``[B, T]``) is required when
    ``config.entropy_coef != 0`` and logged when given; ``distill`` (``[B, T]``, the
    per-token divergence to the teacher) counts on ``distill_mask`` when
    ``config.distill_coef > 0``. ``normalizer``/``num_sequences`` are the optimizer step's
    label tokens and sequences (default: this micro-batch's); ``max_tokens`` is
    ``dr_grpo``'s constant (default: the padded length).
    """
    cfg = config if config is not None else LossConfig()
    valid = loss_mask.to(torch.bool)
    mask = valid.float()
    if advantages.dim() == 1:
        advantages = advantages.view(-1, 1).expand_as(mask)
    advantages = advantages.to(mask.dtype)
    objective = _objective(
        logprobs, advantages, mask, valid, cfg, inference_logprobs, inference_mask, old_logprobs
    )
    per_token, kl, distill, d_mask = _regularisers(
        -objective.surrogate,
        logprobs,
        valid,
        mask,
        cfg,
        ref_logprobs,
        entropy,
        distill,
        distill_mask,
    )
    loss = _aggregate(per_token * mask, mask, cfg.loss_type, normalizer, num_sequences, max_tokens)
    with torch.no_grad():
        metrics = _policy_metrics(logprobs, advantages, mask, objective, cfg)
        if entropy is not None:
            metrics["train/entropy"] = (entropy.detach() * mask).sum() / mask.sum().clamp(min=1.0)
        if inference_logprobs is not None:
            metrics.update(_sampler_metrics(logprobs, objective))
        metrics.update(_regulariser_metrics(mask, cfg, kl, distill, d_mask))
        if objective.is_stats is not None:
            metrics.update({f"off_policy/{k}": v for k, v in objective.is_stats.items()})
    return LossOutput(loss=loss, metrics=metrics)


# --- the objective -------------------------------------------------------------------------


def _objective(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    valid: torch.Tensor,
    cfg: LossConfig,
    inference_logprobs: torch.Tensor | None,
    inference_mask: torch.Tensor | None,
    old_logprobs: torch.Tensor | None,
) -> _Objective:
    """PPO's clipped surrogate against the sampler, with the run's correction and caps."""
    low = cfg.clip_eps
    high = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
    has_old = inference_logprobs is not None
    trainer_old = logp.detach() if old_logprobs is None else old_logprobs.to(logp.dtype)
    if has_old:
        present = sampler_mask(inference_logprobs) if inference_mask is None else inference_mask
        present = present.to(torch.bool) & valid
        sampler_lp = torch.where(present, inference_logprobs.to(logp.dtype), trainer_old)
    else:
        present = torch.zeros_like(valid)
        sampler_lp = trainer_old
    correction = cfg.off_policy if (has_old and cfg.off_policy.active) else None
    is_stats = None
    weights = None
    reference = sampler_lp
    if correction is not None and correction.truncate:
        weights, is_stats = truncated_weights(
            trainer_old, sampler_lp, present, correction.clip, logp.detach()
        )
        reference = trainer_old
    if cfg.importance_sampling_level == "sequence" and correction is not None:
        if not correction.truncate:
            raise ValueError(
                "importance_sampling_level 'sequence' works with off_policy_correction none "
                "or tis with tis_mode truncate"
            )
    ratio = _ratio(logp, reference, mask, cfg.importance_sampling_level)
    surrogate = torch.min(ratio * advantages, ratio.clamp(1.0 - low, 1.0 + high) * advantages)
    if weights is not None:
        surrogate = surrogate * weights
    elif correction is not None:
        corrected, sampler_ratio, is_stats = corrected_surrogate(
            logp,
            sampler_lp,
            advantages,
            present.to(mask.dtype),
            low,
            correction,
            clip_eps_high=high,
        )
        # Tokens without a sampler log-prob keep the plain surrogate against the trainer.
        surrogate = torch.where(present, corrected, surrogate)
        ratio = torch.where(present, sampler_ratio, ratio)
    if cfg.clip_ratio_c is not None:
        surrogate = torch.where(
            advantages < 0, torch.maximum(surrogate, cfg.clip_ratio_c * advantages), surrogate
        )
    return _Objective(surrogate, ratio, present, sampler_lp, is_stats)


def _ratio(
    logp: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor, level: str
) -> torch.Tensor:
    """The importance ratio per token: clamped per token, or GSPO's per sequence."""
    if level == "sequence":
        seq_len = mask.sum(-1).clamp(min=1.0)
        seq_log_ratio = ((logp - reference) * mask).sum(-1) / seq_len
        # GSPO-token: value s_i = exp(mean log-ratio), gradient s_i·∇logp_t per token.
        log_ratio = (logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1)) * mask
        return torch.exp(log_ratio.clamp(max=MAX_SEQ_LOG_RATIO))
    return torch.exp(((logp - reference) * mask).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


# --- the regularisers ----------------------------------------------------------------------


def _regularisers(
    per_token: torch.Tensor,
    logp: torch.Tensor,
    valid: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    ref_logprobs: torch.Tensor | None,
    entropy: torch.Tensor | None,
    distill: torch.Tensor | None,
    distill_mask: torch.Tensor | None,
) -> Tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Add the KL, entropy and distillation terms to the per-token loss.

    Returns the loss, the masked KL and distillation terms (for the metrics; None when
    absent) and the distillation mask.
    """
    kl = None
    if ref_logprobs is not None:
        kl = kl_penalty(logp, ref_logprobs, cfg.kl_estimator) * mask
        if cfg.loss_kl_coef > 0:
            per_token = per_token + cfg.loss_kl_coef * kl
    if cfg.entropy_coef != 0:
        if entropy is None:
            raise ValueError("entropy_coef != 0 needs the per-token entropy")
        per_token = per_token - cfg.entropy_coef * entropy
    d_mask = None
    if distill is not None and cfg.distill_coef > 0:
        d_mask = valid if distill_mask is None else distill_mask.to(torch.bool) & valid
        distill = distill * d_mask.to(distill.dtype)
        weighted = cfg.distill_coef * distill
        per_token = weighted if cfg.distill_only else per_token + weighted
    else:
        distill = None
        if cfg.distill_only:
            per_token = per_token * 0.0  # a micro-batch without teacher rows trains on nothing
    return per_token, kl, distill, d_mask


def _aggregate(
    token_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    normalizer: float | None,
    num_sequences: int | None,
    max_tokens: int | None,
) -> torch.Tensor:
    """Reduce the masked per-token loss ``[B, T]`` to the scalar of ``loss_type``."""
    if loss_type == "token-mean":
        denom = normalizer if normalizer is not None else mask.sum().clamp(min=1.0)
        return token_loss.sum() / denom
    n_seq = num_sequences if num_sequences is not None else token_loss.size(0)
    if loss_type == "grpo":
        return (token_loss.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / n_seq
    if loss_type == "seq-mean-token-sum":
        return token_loss.sum() / n_seq
    length = max_tokens if max_tokens is not None else token_loss.size(1)
    return token_loss.sum() / (n_seq * length)  # dr_grpo


# --- the metrics ---------------------------------------------------------------------------


def _policy_metrics(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    objective: _Objective,
    cfg: LossConfig,
) -> Stats:
    """Ratio, clipping and log-prob statistics of the policy-gradient term."""
    low = cfg.clip_eps
    high = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
    n_tokens = mask.sum()
    tok = n_tokens.clamp(min=1.0)
    seq_len = mask.sum(-1).clamp(min=1)
    seq_adv = (advantages * mask).sum(-1) / seq_len
    seq_logp = (logp * mask).sum(-1) / seq_len
    pos, neg = (seq_adv > 0).float(), (seq_adv < 0).float()
    ratio = objective.ratio
    r = ratio.detach()
    # Only tokens whose gradient the clip removes (as TRL counts): a ratio past the band on
    # the side its advantage pushes towards.
    clipped = (((advantages > 0) & (r > 1.0 + high)) | ((advantages < 0) & (r < 1.0 - low))).to(
        mask.dtype
    ) * mask
    mean_logp = (logp * mask).sum() / tok
    sampled = objective.present.to(mask.dtype)
    metrics = {
        "grpo/mean_ratio": (ratio * mask).sum() / tok,
        "grpo/clipped_fraction": clipped.sum() / tok,
        "train/logp": mean_logp,
        "train/pos_logp": (seq_logp * pos).sum() / pos.sum().clamp(min=1),
        "train/neg_logp": (seq_logp * neg).sum() / neg.sum().clamp(min=1),
        "logprobs/training_mean": mean_logp,
        "logprobs/training_std": _masked_std(logp, mask),
        "train/num_tokens": n_tokens,
        "grpo/has_inference_logprobs": sampled.sum() / tok,
        "grpo/sampler_tokens": sampled.sum(),
    }
    if cfg.clip_ratio_c is not None:
        dual = ((advantages < 0) & (r > cfg.clip_ratio_c)).to(mask.dtype) * mask
        metrics["grpo/dual_clipped_fraction"] = dual.sum() / tok
    return metrics


def _sampler_metrics(logp: torch.Tensor, objective: _Objective) -> Stats:
    """How the trainer's log-probs compare with the sampler's, on the tokens it sent."""
    sampler_lp = objective.sampler_lp
    sampled = objective.present.float()
    n_old = sampled.sum().clamp(min=1.0)
    diff = (logp - sampler_lp) * sampled
    return {
        "logprobs/inference_mean": (sampler_lp * sampled).sum() / n_old,
        "logprobs/inference_std": _masked_std(sampler_lp, sampled),
        "alignment/diff_mean": diff.sum() / n_old,
        "alignment/diff_abs_mean": diff.abs().sum() / n_old,
        "alignment/diff_max": diff.abs().amax() if diff.numel() else n_old * 0,
    }


def _regulariser_metrics(
    mask: torch.Tensor,
    cfg: LossConfig,
    kl: torch.Tensor | None,
    distill: torch.Tensor | None,
    d_mask: torch.Tensor | None,
) -> Stats:
    """``train/kl`` when a reference was given; ``distill/*`` on every micro-batch of a
    distilling run (zeros without teacher rows, so every micro-batch logs the same keys)."""
    tok = mask.sum().clamp(min=1.0)
    metrics: Stats = {}
    if kl is not None:
        metrics["train/kl"] = (kl * mask).sum() / tok
    if cfg.distill_coef > 0:
        if distill is None or d_mask is None:
            metrics["distill/kl"] = tok * 0
            metrics["distill/tokens"] = tok * 0
        else:
            n_distill = d_mask.to(mask.dtype).sum()
            metrics["distill/kl"] = distill.detach().sum() / n_distill.clamp(min=1.0)
            metrics["distill/tokens"] = n_distill
    return metrics


def _masked_std(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sample standard deviation over the masked entries (0 with fewer than two)."""
    n = mask.sum()
    mean = (values * mask).sum() / n.clamp(min=1)
    var = (((values - mean) ** 2) * mask).sum() / (n - 1).clamp(min=1)
    return torch.where(n >= 2, var.sqrt(), torch.zeros_like(var))
