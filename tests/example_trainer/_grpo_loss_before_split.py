"""The GRPO loss as it was before the split into ``example_trainer/loss.py``, kept frozen so
``test_loss_split.py`` can check that the split changed no result (loss, gradient, metrics)."""

from __future__ import annotations

import torch

from example_trainer.conventions import IGNORE_INDEX
from example_trainer.distill import distill_divergence
from example_trainer.kl import kl_penalty
from example_trainer.loss import LossOutput
from example_trainer.loss_config import LossConfig
from example_trainer.off_policy import MAX_LOG_RATIO, corrected_surrogate, truncated_weights
from example_trainer.training import token_entropy, token_logprobs

MAX_SEQ_LOG_RATIO = 10.0


def sampler_mask(inference_logprobs: torch.Tensor) -> torch.Tensor:
    """Tokens whose ``inference_logprobs`` entry is a log-prob (finite and <= 0), not the
    1.0 "not generated" marker."""
    return torch.isfinite(inference_logprobs) & (inference_logprobs <= 0)


def grpo_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    advantages: torch.Tensor,
    temperatures: torch.Tensor | None = None,
    inference_logprobs: torch.Tensor | None = None,
    config: LossConfig | None = None,
    *,
    ref_logprobs: torch.Tensor | None = None,
    inference_mask: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    normalizer: float | None = None,
    num_sequences: int | None = None,
    max_tokens: int | None = None,
    distill_token_ids: torch.Tensor | None = None,
    distill_logprobs: torch.Tensor | None = None,
    distill_mask: torch.Tensor | None = None,
) -> LossOutput:
    """The pre-split ``grpo_loss``, unchanged."""
    cfg = config if config is not None else LossConfig()
    off_policy = cfg.off_policy
    clip_ratio_c = cfg.clip_ratio_c
    distill_coef = cfg.distill_coef
    valid = labels != IGNORE_INDEX
    mask = valid.float()
    if advantages.dim() == 1:
        advantages = advantages.view(-1, 1).expand_as(mask)
    advantages = advantages.to(mask.dtype)
    logp = token_logprobs(logits, labels, temperatures)
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
    correction = off_policy if (has_old and off_policy.active) else None
    is_stats = None
    weights = None
    reference = sampler_lp
    if correction is not None and correction.truncate:
        weights, is_stats = truncated_weights(
            trainer_old, sampler_lp, present, correction.clip, logp.detach()
        )
        reference = trainer_old
    if cfg.importance_sampling_level == "sequence":
        if correction is not None and not correction.truncate:
            raise ValueError(
                "importance_sampling_level 'sequence' works with off_policy_correction none "
                "or tis with tis_mode truncate"
            )
        seq_len = mask.sum(-1).clamp(min=1.0)
        seq_log_ratio = ((logp - reference) * mask).sum(-1) / seq_len
        # GSPO-token: value s_i = exp(mean log-ratio), gradient s_i·∇logp_t per token.
        log_ratio = (logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1)) * mask
        ratio = torch.exp(log_ratio.clamp(max=MAX_SEQ_LOG_RATIO))
    else:
        ratio = torch.exp(((logp - reference) * mask).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
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
    if clip_ratio_c is not None:
        surrogate = torch.where(
            advantages < 0, torch.maximum(surrogate, clip_ratio_c * advantages), surrogate
        )
    per_token = -surrogate
    kl = None
    if ref_logprobs is not None:
        kl = kl_penalty(logp, ref_logprobs, cfg.kl_estimator) * mask
        if cfg.loss_kl_coef > 0:
            per_token = per_token + cfg.loss_kl_coef * kl
    entropy = None
    if cfg.entropy_coef != 0:
        entropy = token_entropy(logits, temperatures)
        per_token = per_token - cfg.entropy_coef * entropy
    elif cfg.log_entropy:
        with torch.no_grad():
            entropy = token_entropy(logits.detach(), temperatures)
    distill = None
    if distill_token_ids is not None and distill_logprobs is not None and distill_coef > 0:
        d_mask = valid if distill_mask is None else distill_mask.to(torch.bool) & valid
        distill = distill_divergence(
            logits, distill_token_ids, distill_logprobs, cfg.distill_temperature
        )
        distill = distill * d_mask.to(distill.dtype)
        per_token = (
            distill_coef * distill if cfg.distill_only else per_token + distill_coef * distill
        )
    elif cfg.distill_only:
        per_token = per_token * 0.0  # a micro-batch without teacher rows trains on nothing
    n_tokens = mask.sum()
    loss = _aggregate(per_token * mask, mask, cfg.loss_type, normalizer, num_sequences, max_tokens)

    with torch.no_grad():
        tok = n_tokens.clamp(min=1.0)
        seq_len = mask.sum(-1).clamp(min=1)
        seq_adv = (advantages * mask).sum(-1) / seq_len
        seq_logp = (logp * mask).sum(-1) / seq_len
        pos, neg = (seq_adv > 0).float(), (seq_adv < 0).float()
        r = ratio.detach()
        # Only tokens whose gradient the clip removes (as TRL counts): a ratio past the
        # band on the side its advantage pushes towards.
        clipped = (((advantages > 0) & (r > 1.0 + high)) | ((advantages < 0) & (r < 1.0 - low))).to(
            mask.dtype
        ) * mask
        mean_logp = (logp * mask).sum() / tok
        sampled = present.to(mask.dtype)
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
        if clip_ratio_c is not None:
            dual = ((advantages < 0) & (r > clip_ratio_c)).to(mask.dtype) * mask
            metrics["grpo/dual_clipped_fraction"] = dual.sum() / tok
        if entropy is not None:
            metrics["train/entropy"] = (entropy.detach() * mask).sum() / tok
        if has_old:
            n_old = sampled.sum().clamp(min=1.0)
            diff = (logp - sampler_lp) * sampled
            metrics.update(
                {
                    "logprobs/inference_mean": (sampler_lp * sampled).sum() / n_old,
                    "logprobs/inference_std": _masked_std(sampler_lp, sampled),
                    "alignment/diff_mean": diff.sum() / n_old,
                    "alignment/diff_abs_mean": diff.abs().sum() / n_old,
                    "alignment/diff_max": diff.abs().amax() if diff.numel() else tok * 0,
                }
            )
        if kl is not None:
            metrics["train/kl"] = (kl * mask).sum() / tok
        if distill_coef > 0:  # every micro-batch logs the same keys
            if distill is None:
                metrics["distill/kl"] = tok * 0
                metrics["distill/tokens"] = tok * 0
            else:
                n_distill = d_mask.to(mask.dtype).sum()
                metrics["distill/kl"] = distill.detach().sum() / n_distill.clamp(min=1.0)
                metrics["distill/tokens"] = n_distill
        if is_stats is not None:
            metrics.update({f"off_policy/{k}": v for k, v in is_stats.items()})
    return LossOutput(loss=loss, metrics=metrics)


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


def _masked_std(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sample standard deviation over the masked entries (0 with fewer than two)."""
    n = mask.sum()
    mean = (values * mask).sum() / n.clamp(min=1)
    var = (((values - mean) ** 2) * mask).sum() / (n - 1).clamp(min=1)
    return torch.where(n >= 2, var.sqrt(), torch.zeros_like(var))
