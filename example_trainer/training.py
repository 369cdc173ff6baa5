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

:func:`grpo_loss` turns the logits into per-token log-probs (and the entropy and the
teacher divergence when asked for); the objective, the regularisers, the aggregation and
the metrics over those are :func:`example_trainer.loss.compute_loss`'s.

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
from typing import Any, Dict, List, Tuple

import torch
import torch.nn.functional as F

from .conventions import IGNORE_INDEX
from .distill import distill_divergence
from .loss import MAX_SEQ_LOG_RATIO as MAX_SEQ_LOG_RATIO  # re-exported from their old home
from .loss import LossOutput as LossOutput
from .loss import compute_loss
from .loss import sampler_mask as sampler_mask
from .loss_config import LossConfig
from .metrics import start_wandb

logger = logging.getLogger(__name__)


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
    """GRPO loss for one micro-batch from its logits, with the options of ``config`` (a
    :class:`~example_trainer.loss_config.LossConfig`; default: PPO's clip at 0.2, no KL,
    ``token-mean``). See the module docstring for the formula.

    The logits give the per-token log-probs of ``labels`` (``−100``: not a label), the
    entropy (when ``config`` adds or logs it) and the divergence to the teacher's top-k;
    :func:`~example_trainer.loss.compute_loss` does the rest.
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
    logp = token_logprobs(logits, labels, temperatures)
    entropy = None
    if cfg.entropy_coef != 0:
        entropy = token_entropy(logits, temperatures)
    elif cfg.log_entropy:
        with torch.no_grad():
            entropy = token_entropy(logits.detach(), temperatures)
    distill = None
    if distill_token_ids is not None and distill_logprobs is not None and cfg.distill_coef > 0:
        distill = distill_divergence(
            logits, distill_token_ids, distill_logprobs, cfg.distill_temperature
        )
    return compute_loss(
        logp,
        inference_logprobs,
        advantages,
        labels != IGNORE_INDEX,
        cfg,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        inference_mask=inference_mask,
        entropy=entropy,
        distill=distill,
        distill_mask=distill_mask,
        normalizer=normalizer,
        num_sequences=num_sequences,
        max_tokens=max_tokens,
    )


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
