"""The GRPO loss: a PPO-style clipped surrogate against the rollout policy.

``compute_grpo_loss`` is a pure function of logits and batch tensors:

- per-token log-probs of the labels under ``logits / temperature``;
- importance ratio ``r = exp(logp − old_logp)`` where ``old_logp`` is the rollout's
  ``inference_logprobs``; when the batch carries none, the current policy's
  detached log-probs are used (``r = 1``, the plain GRPO/REINFORCE gradient)
  instead of failing as the original did;
- pessimistic clipped objective per token, ``min(r·A, clip(r, 1−ε, 1+ε)·A)``
  (for A < 0 this is the larger |loss|, i.e. the ratio is clipped only where it
  would make the update more optimistic);
- optional off-policy correction (``tis``/``icepop``, :mod:`.off_policy`): the same
  clipped surrogate against the sampler, with the weight of the tokens the clip leaves
  active truncated at ``--off-policy-clip`` (``tis``) or the tokens whose ratio is out of
  band masked (``icepop``);
- optional KL penalty (k3 estimator) towards reference log-probs, weighted by
  ``kl_coef``;
- token-level averaging: the sum over all label tokens divided by ``normalizer``
  (by default the label tokens of this micro-batch; the trainer passes the count
  over the whole optimizer step so that gradient accumulation is exact).

Nothing here reads a value back to the host: the statistics are 0-d tensors on the
logits' device, so a GPU step runs without waiting for the host until the trainer
reads all its metrics at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import torch
import torch.nn.functional as F

from .data import IGNORE_INDEX
from .off_policy import CorrectionConfig, corrected_surrogate


@dataclass
class LossOutput:
    """The scalar loss to backpropagate plus detached statistics (0-d tensors) for logging."""

    loss: torch.Tensor
    metrics: Dict[str, torch.Tensor]


def token_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, temperatures: torch.Tensor | None = None
) -> torch.Tensor:
    """Log-probability of each label under ``logits / temperature``; 0 where label is −100.

    ``logits`` is ``[B, T, V]``, ``labels`` ``[B, T]`` and ``temperatures`` ``[B]``
    (pass None when all are 1; checking that here would wait for the device).
    """
    if temperatures is not None:
        # Callers pass None at temperature 1: the division copies the [B, T, V] logits.
        logits = logits / temperatures.to(logits.dtype).view(-1, 1, 1)
    logits = logits.float()
    safe = labels.clamp(min=0)
    nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), safe.reshape(-1), reduction="none")
    logp = -nll.view_as(labels)
    return logp * (labels != IGNORE_INDEX)


def compute_grpo_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    advantages: torch.Tensor,
    temperatures: torch.Tensor | None = None,
    inference_logprobs: torch.Tensor | None = None,
    clip_eps: float = 0.2,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    normalizer: float | None = None,
    off_policy: CorrectionConfig | None = None,
) -> LossOutput:
    """GRPO loss for one micro-batch. See the module docstring for the formula.

    ``advantages`` is per token ``[B, T]`` (or per sequence ``[B]``, broadcast).
    ``off_policy`` (``tis`` or ``icepop``, see :mod:`.off_policy`): with inference
    log-probs, the surrogate's ratio to the sampler is truncated (``tis``) or its
    out-of-band tokens masked (``icepop``); without, it changes nothing.
    """
    mask = (labels != IGNORE_INDEX).float()
    if advantages.dim() == 1:
        advantages = advantages.view(-1, 1).expand_as(mask)
    advantages = advantages.to(mask.dtype)
    logp = token_logprobs(logits, labels, temperatures)
    has_old = inference_logprobs is not None
    old_logp = inference_logprobs.to(logp.dtype) if has_old else logp.detach()
    is_stats = None
    if has_old and off_policy is not None and off_policy.active:
        surrogate, ratio, is_stats = corrected_surrogate(
            logp, old_logp, advantages, mask, clip_eps, off_policy
        )
    else:
        ratio = torch.exp((logp - old_logp) * mask)
        surrogate = torch.min(
            ratio * advantages, ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * advantages
        )
    per_token = -surrogate
    kl = None
    if kl_coef > 0 and ref_logprobs is not None:
        delta = (ref_logprobs.to(logp.dtype) - logp) * mask
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + kl_coef * kl
    n_tokens = mask.sum()
    denom = normalizer if normalizer is not None else n_tokens.clamp(min=1.0)
    loss = (per_token * mask).sum() / denom

    with torch.no_grad():
        tok = n_tokens.clamp(min=1.0)
        seq_len = mask.sum(-1).clamp(min=1)
        seq_adv = (advantages * mask).sum(-1) / seq_len
        seq_logp = (logp * mask).sum(-1) / seq_len
        pos, neg = (seq_adv > 0).float(), (seq_adv < 0).float()
        clipped_ratio = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
        clipped = ((ratio - clipped_ratio).abs() > 1e-6).float() * mask
        mean_logp = (logp * mask).sum() / tok
        metrics = {
            "grpo/mean_ratio": (ratio * mask).sum() / tok,
            "grpo/clipped_fraction": clipped.sum() / tok,
            "train/logp": mean_logp,
            "train/pos_logp": (seq_logp * pos).sum() / pos.sum().clamp(min=1),
            "train/neg_logp": (seq_logp * neg).sum() / neg.sum().clamp(min=1),
            "logprobs/training_mean": mean_logp,
            "logprobs/training_std": _masked_std(logp, mask),
            "train/num_tokens": n_tokens,
            "grpo/has_inference_logprobs": torch.tensor(
                1.0 if has_old else 0.0, device=logp.device
            ),
        }
        if has_old:
            diff = (logp - old_logp) * mask
            metrics.update(
                {
                    "logprobs/inference_mean": (old_logp * mask).sum() / tok,
                    "logprobs/inference_std": _masked_std(old_logp, mask),
                    "alignment/diff_mean": diff.sum() / tok,
                    "alignment/diff_abs_mean": diff.abs().sum() / tok,
                    "alignment/diff_max": diff.abs().amax() if diff.numel() else tok * 0,
                }
            )
        if kl is not None:
            metrics["train/kl"] = (kl * mask).sum() / tok
        if is_stats is not None:
            metrics.update({f"off_policy/{k}": v for k, v in is_stats.items()})
    return LossOutput(loss=loss, metrics=metrics)


def _masked_std(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sample standard deviation over the masked entries (0 with fewer than two)."""
    n = mask.sum()
    mean = (values * mask).sum() / n.clamp(min=1)
    var = (((values - mean) ** 2) * mask).sum() / (n - 1).clamp(min=1)
    return torch.where(n >= 2, var.sqrt(), torch.zeros_like(var))
