"""A step's statistics, kept on the device and read back to the host once.

Every micro-batch's loss statistics (0-d device tensors, see
:func:`~example_trainer.training.grpo_loss`) are added into one accumulator tensor;
at the end of the optimizer step the ranks combine it and the host reads it, with the
gradient norm that decides whether the last update is applied, in one transfer.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

MEAN_KEYS = (
    "grpo/mean_ratio",
    "grpo/clipped_fraction",
    "train/logp",
    "train/pos_logp",
    "train/neg_logp",
    "logprobs/training_mean",
    "logprobs/training_std",
    "grpo/has_inference_logprobs",
    "logprobs/inference_mean",
    "logprobs/inference_std",
    "alignment/diff_mean",
    "alignment/diff_abs_mean",
    "train/kl",
    "off_policy/mean_ratio",
    "off_policy/clip_fraction",
    "off_policy/mismatch_kl",
    "train/entropy",
    "grpo/dual_clipped_fraction",
    "distill/kl",
)
"""Statistics averaged over the step's label tokens (weighted by each micro-batch's share)."""
SAMPLER_KEYS = frozenset(
    {
        "logprobs/inference_mean",
        "logprobs/inference_std",
        "alignment/diff_mean",
        "alignment/diff_abs_mean",
        "off_policy/mean_ratio",
        "off_policy/clip_fraction",
        "off_policy/mismatch_kl",
    }
)
"""Statistics over the tokens with a sampler log-prob: weighted by those tokens' count, so a
micro-batch without sampler log-probs does not dilute them."""
DISTILL_KEYS = frozenset({"distill/kl"})
"""Means over the tokens with a teacher row (weighted by ``distill/tokens``)."""
COUNTED_KEYS = SAMPLER_KEYS | DISTILL_KEYS
SUM_KEYS = ("train/num_tokens", "train/loss")
MAX_KEYS = ("alignment/diff_max", "train/grad_norm")


class StepStats:
    """The running statistics of one batch's optimizer steps (``updates`` of them, over
    ``ppo_epochs`` passes), on ``device``.

    ``total_tokens`` is the label tokens of all passes: each micro-batch's means count
    with its share of them.
    """

    def __init__(self, device: Any, total_tokens: float, ppo_epochs: int, updates: int) -> None:
        n_mean, n_sum = len(MEAN_KEYS), len(SUM_KEYS)
        # [means (weighted sums) | sums | weight of each mean]
        self.acc = torch.zeros(n_mean + n_sum + n_mean, device=device)
        self.peak = torch.zeros(len(MAX_KEYS), device=device)
        self.total_tokens = total_tokens
        self.ppo_epochs = ppo_epochs
        self.updates = updates

    def add(self, metrics: Dict[str, torch.Tensor]) -> None:
        """Add one micro-batch's statistics (its ``grpo_loss`` metrics and ``train/loss``)."""
        acc, n_mean, n_sum = self.acc, len(MEAN_KEYS), len(SUM_KEYS)
        weight = metrics["train/num_tokens"] / self.total_tokens
        sampled = metrics["grpo/sampler_tokens"]
        for m, key in enumerate(MEAN_KEYS):
            if key not in metrics:
                continue
            if key in COUNTED_KEYS:  # a mean over the tokens that have the value
                count = metrics["distill/tokens"] if key in DISTILL_KEYS else sampled
                acc[m] += metrics[key] * count
                acc[n_mean + n_sum + m] += count
            else:
                acc[m] += metrics[key] * weight
                acc[n_mean + n_sum + m] += 1.0
        acc[n_mean] += metrics["train/num_tokens"] / self.ppo_epochs
        acc[n_mean + 1] += metrics["train/loss"] / self.updates
        if "alignment/diff_max" in metrics:
            self.peak[0] = torch.maximum(self.peak[0], metrics["alignment/diff_max"])

    def add_grad_norm(self, grad_norm: torch.Tensor) -> None:
        """Keep the largest gradient norm of the step's updates."""
        self.peak[1] = torch.maximum(self.peak[1], grad_norm)

    def read_back(self, ctx: Any, grad_norm: torch.Tensor) -> tuple[Dict[str, float], float]:
        """Combine over the ranks (``ctx``) and read everything, with the last update's
        ``grad_norm``, in one device→host transfer (the step's one host sync).

        Returns the statistics by name and the last gradient norm.
        """
        ctx.all_reduce(self.acc)
        ctx.all_reduce(self.peak, op="max")
        acc = self.acc
        values = torch.cat([acc, self.peak, grad_norm.reshape(1).to(acc)]).tolist()
        n_mean, n_sum = len(MEAN_KEYS), len(SUM_KEYS)
        out: Dict[str, float] = {}
        for m, key in enumerate(MEAN_KEYS):
            count = values[n_mean + n_sum + m]
            if count > 0:
                out[key] = values[m] / count if key in COUNTED_KEYS else values[m]
        for m, key in enumerate(SUM_KEYS):
            out[key] = values[n_mean + m]
        if "alignment/diff_mean" in out:
            out["alignment/diff_max"] = values[len(acc)]
        out["train/grad_norm"] = values[len(acc) + 1]
        return out, values[-1]
