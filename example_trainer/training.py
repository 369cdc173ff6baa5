"""The GRPO loss: a PPO-style clipped surrogate against the rollout policy.

``compute_grpo_loss`` is a pure function of logits and batch tensors:

- per-token log-probs of the labels under ``logits / temperature`` (in float32);
- importance ratio ``r = exp(clamp(logp − old_logp, ±20))`` where ``old_logp`` is the
  rollout's ``inference_logprobs``; a token without one (``inference_mask`` false: the
  sequence sent none, its row was short, or it holds the 1.0 marker) uses the current
  policy's detached log-prob (``r = 1``, the plain GRPO/REINFORCE gradient) instead of
  failing as the original did. The clamp keeps one absurd sampler log-prob (vLLM writes
  −9999 for some tokens) from producing an infinite ratio and NaN gradients;
- pessimistic clipped objective per token, ``min(r·A, clip(r, 1−ε_low, 1+ε_high)·A)``
  (``ε_high = clip_eps_high``, default ``ε_low = clip_eps``: DAPO's clip-higher); for
  A < 0 this is the larger |loss|; with ``clip_ratio_c = c`` (dual-clip PPO) the loss of
  an A < 0 token is capped at ``−c·A`` (no gradient once ``r > c``);
- optional off-policy correction (``tis``/``icepop``, :mod:`.off_policy`): the same
  clipped surrogate against the sampler, with the weight of the tokens the clip leaves
  active truncated at ``--off-policy-clip`` (``tis``) or the tokens whose ratio is out of
  band masked (``icepop``);
- optional KL penalty (k3 estimator) towards reference log-probs, weighted by
  ``kl_coef``, and entropy bonus ``−entropy_coef·H`` (``H`` the entropy of the
  tempered next-token distribution);
- aggregation of the per-token loss ``l`` by ``loss_type`` over the optimizer step's
  ``N`` label tokens and ``B`` sequences (the trainer passes both, so that gradient
  accumulation is exact): ``token-mean`` ``Σl / N`` (default), ``grpo``
  ``(1/B) Σ_i mean_t l``, ``seq-mean-token-sum`` ``(1/B) Σ_i Σ_t l``, ``dr_grpo``
  ``Σl / (B·max_tokens)``.

Nothing here reads a value back to the host: the statistics are 0-d tensors on the
logits' device, so a GPU step runs without waiting for the host until the trainer
reads all its metrics at once.

The original's step-level functions live here too: ``compute_grpo_loss`` in its model form
(:func:`model_grpo_loss`), ``run_training_step``, ``setup_wandb``, ``log_metrics`` and
``finalize_training``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import torch
import torch.nn.functional as F

from .conventions import IGNORE_INDEX
from .distill import distill_divergence
from .kl import kl_penalty
from .loss_config import LossConfig
from .metrics import start_wandb
from .off_policy import MAX_LOG_RATIO, corrected_surrogate, truncated_weights

logger = logging.getLogger(__name__)

MAX_SEQ_LOG_RATIO = 10.0
"""GSPO's per-token log-ratio is capped at this (verl's value)."""


@dataclass
class LossOutput:
    """The scalar loss to backpropagate plus detached statistics (0-d tensors) for logging."""

    loss: torch.Tensor
    metrics: Dict[str, torch.Tensor]


def _tempered(logits: torch.Tensor, temperatures: torch.Tensor | None) -> torch.Tensor:
    # float32 before dividing: a bf16 logit divided by 0.7 loses the low bits the ratio
    # to the sampler is made of.
    logits = logits.float()
    if temperatures is not None:
        logits = logits / temperatures.to(logits.dtype).view(-1, 1, 1)
    return logits


def token_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, temperatures: torch.Tensor | None = None
) -> torch.Tensor:
    """Log-probability of each label under ``logits / temperature``; 0 where label is −100.

    ``logits`` is ``[B, T, V]``, ``labels`` ``[B, T]`` and ``temperatures`` ``[B]``
    (pass None when all are 1; checking that here would wait for the device). Computed
    in float32.
    """
    logits = _tempered(logits, temperatures)
    safe = labels.clamp(min=0)
    nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), safe.reshape(-1), reduction="none")
    logp = -nll.view_as(labels)
    return logp * (labels != IGNORE_INDEX)


ENTROPY_CHUNK = 1024
"""Positions per chunk when the entropy is only logged: a float32 softmax over a 150k
vocabulary for a whole micro-batch would be gigabytes on top of the logits."""


def token_entropy(logits: torch.Tensor, temperatures: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy ``H = logsumexp(z) − Σ softmax(z)·z`` of each position's next-token
    distribution, ``z = logits / temperature`` (float32), ``[B, T]``.

    Without a gradient it is computed :data:`ENTROPY_CHUNK` positions at a time.
    """
    if logits.requires_grad and torch.is_grad_enabled():
        z = _tempered(logits, temperatures)
        return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)
    b, t, v = logits.shape
    flat = logits.reshape(b * t, v)
    scale = None
    if temperatures is not None:
        scale = temperatures.float().repeat_interleave(t)
    out = torch.empty(b * t, dtype=torch.float32, device=logits.device)
    for start in range(0, b * t, ENTROPY_CHUNK):
        z = flat[start : start + ENTROPY_CHUNK].float()
        if scale is not None:
            z = z / scale[start : start + ENTROPY_CHUNK, None]
        out[start : start + ENTROPY_CHUNK] = torch.logsumexp(z, -1) - (
            torch.softmax(z, -1) * z
        ).sum(-1)
    return out.view(b, t)


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
    """GRPO loss for one micro-batch, with the options of ``config`` (a
    :class:`~example_trainer.loss_config.LossConfig`; default: PPO's clip at 0.2, no KL,
    ``token-mean``). See the module docstring for the formula.

    ``advantages`` is per token ``[B, T]`` (or per sequence ``[B]``, broadcast).
    ``inference_mask`` (bool ``[B, T]``) marks the tokens that have a sampler log-prob
    (default: those whose value is a log-prob, see :func:`sampler_mask`).
    ``ref_logprobs`` are the reference policy's (the KL term's anchor, weighted by
    ``config.kl_coef``; logged as ``train/kl`` even when the weight is 0).
    ``old_logprobs`` are the trainer's own log-probs before the batch's first update
    (when a batch is trained on in several optimizer steps): the ratio's reference for
    tokens without a sampler log-prob, and ``--tis-mode truncate``'s PPO reference;
    default: the current policy's, detached. Metrics that compare with the sampler
    (``grpo/has_inference_logprobs``, ``alignment/*``, ``off_policy/*``) use only the
    sampler's log-probs.
    ``normalizer``/``num_sequences`` are the optimizer step's label tokens and
    sequences (default: this micro-batch's); ``max_tokens`` is ``dr_grpo``'s constant
    (default: the padded length).
    ``distill_*`` (the micro-batch's teacher top-k, :mod:`.distill`): with
    ``config.distill_coef > 0`` the positions of ``distill_mask`` add ``distill_coef`` times
    the reverse KL to the teacher's top-k at ``distill_temperature``; ``distill_only``
    keeps that term alone (no policy-gradient, KL or entropy term).

    Example::

        out = grpo_loss(logits, labels, adv, temps, inference_lp, LossConfig(clip_eps_high=0.28))
        out.loss.backward()
    """
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


def model_grpo_loss(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    advantages: torch.Tensor,
    temperatures: torch.Tensor,
    gradient_accumulation_steps: int,
    inference_logprobs: torch.Tensor | None = None,
    clip_eps: float = 0.2,
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """The original's ``compute_grpo_loss``: forward ``tokens`` through ``model`` and return
    ``(loss / gradient_accumulation_steps, metrics)`` of :func:`grpo_loss`."""
    device = next(model.parameters()).device
    logits = model(input_ids=tokens.to(device)).logits
    temps = temperatures.reshape(-1).to(device) if temperatures is not None else None
    out = grpo_loss(
        logits,
        labels.to(device),
        advantages.to(device),
        temps,
        inference_logprobs.to(device) if inference_logprobs is not None else None,
        LossConfig(clip_eps=clip_eps),
    )
    loss = out.loss / max(int(gradient_accumulation_steps), 1)
    metrics = {k: float(v.detach().float().mean()) for k, v in out.metrics.items()}
    return loss, metrics


_MODEL_FORM = (
    "tokens",
    "labels",
    "advantages",
    "temperatures",
    "gradient_accumulation_steps",
    "inference_logprobs",
    "clip_eps",
)


def compute_grpo_loss(model: Any, *args: Any, **kwargs: Any) -> Any:
    """The GRPO loss, in either form.

    The original's, ``compute_grpo_loss(model, tokens, labels, advantages, temperatures,
    gradient_accumulation_steps, inference_logprobs=None, clip_eps=0.2)``, is
    :func:`model_grpo_loss`: it runs the model and returns ``(loss /
    gradient_accumulation_steps, metrics)``. Given logits (a tensor) first, it is
    :func:`grpo_loss`, with its arguments by position or by their names, and returns a
    :class:`LossOutput`.
    """
    if isinstance(model, torch.Tensor):
        return grpo_loss(model, *args, **kwargs)
    if len(args) > len(_MODEL_FORM):
        raise TypeError(
            f"compute_grpo_loss(model, ...) takes at most {len(_MODEL_FORM)} more arguments"
        )
    values: Dict[str, Any] = dict(zip(_MODEL_FORM, args, strict=False))
    for name, value in kwargs.items():
        if name not in _MODEL_FORM:
            raise TypeError(f"compute_grpo_loss(model, ...) got an unexpected argument {name!r}")
        if name in values:
            raise TypeError(f"compute_grpo_loss(model, ...) got {name!r} twice")
        values[name] = value
    missing = [name for name in _MODEL_FORM[:5] if name not in values]
    if missing:
        raise TypeError(f"compute_grpo_loss(model, ...) needs {', '.join(missing)}")
    return model_grpo_loss(model, **values)


# --- the original's step-level helpers -----------------------------------------------------


def run_training_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    token_batches: List[torch.Tensor],
    label_batches: List[torch.Tensor],
    advantage_batches: List[torch.Tensor],
    temperature_batches: List[torch.Tensor],
    config: Any,
    step_idx: int,
    inference_logprob_batches: List[torch.Tensor] | None = None,
) -> dict:
    """One optimizer step over the micro-batches (losses scaled by the config's
    ``gradient_accumulation_steps``, gradients clipped to norm 1). Returns ``loss``,
    ``grad_norm``, ``step`` and the mean of each loss metric."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    sums: Dict[str, float] = {}
    accumulation = int(getattr(config, "gradient_accumulation_steps", 1) or 1)
    for i, tokens in enumerate(token_batches):
        logprobs = inference_logprob_batches[i] if inference_logprob_batches else None
        loss, metrics = model_grpo_loss(
            model,
            tokens,
            label_batches[i],
            advantage_batches[i],
            temperature_batches[i],
            accumulation,
            logprobs,
            float(getattr(config, "clip_eps", 0.2)),
        )
        loss.backward()
        total += float(loss.detach())
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + value
    grad_norm = torch.nn.utils.clip_grad_norm_(
        [p for p in model.parameters() if p.requires_grad], 1.0
    )
    optimizer.step()
    n = max(len(token_batches), 1)
    return {
        "loss": total,
        "grad_norm": float(grad_norm),
        "step": step_idx,
        **{key: value / n for key, value in sums.items()},
    }


def setup_wandb(config: Any) -> bool:
    """Start a W&B run for ``config`` when ``use_wandb``; whether one was started."""
    return start_wandb(config) is not None


def log_metrics(
    metrics: dict,
    step: int,
    use_wandb: bool,
    extra_metrics: dict | None = None,
    benchmark: bool = False,
) -> None:
    """Log one step's metrics (and ``extra_metrics``): a line to the log, and to W&B when
    ``use_wandb``; with ``benchmark`` the step time is included when present."""
    merged = {**metrics, **(extra_metrics or {})}
    shown = ", ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
        for k, v in merged.items()
        if benchmark or "time" not in k
    )
    logger.info("step %d: %s", step, shown)
    if use_wandb:
        import wandb

        wandb.log({f"train/{k}": v for k, v in merged.items()}, step=step)


def finalize_training(
    use_wandb: bool,
    training_start_time: float | None = None,
    mode: str = "unknown",
    total_steps: int = 0,
    benchmark_stats: dict | None = None,
    benchmark: bool = False,
) -> None:
    """Log the run's summary (mode, steps, wall time, benchmark numbers) and close W&B."""
    elapsed = time.time() - training_start_time if training_start_time else None
    summary: Dict[str, Any] = {"mode": mode, "total_steps": total_steps}
    if elapsed is not None:
        summary["total_time_s"] = round(elapsed, 2)
        if total_steps:
            summary["time_per_step_s"] = round(elapsed / total_steps, 3)
    if benchmark and benchmark_stats:
        summary.update(benchmark_stats)
    logger.info("training finished: %s", summary)
    if use_wandb:
        import wandb

        if wandb.run is not None:
            wandb.run.summary.update(summary)
        wandb.finish()
