"""KL estimators between the policy and the reference, per token, bounded.

With ``x = ref_logp − logp`` (the log-ratio reference/policy of a sampled token), clamped
to ``±MAX_KL_LOG_RATIO`` first:

- ``k1``: ``−x`` (``logp − ref_logp``), unbiased, can be negative;
- ``k2``: ``x² / 2``, low variance, biased;
- ``k3``: ``eˣ − x − 1`` (Schulman's estimator, verl's ``low_var_kl``), unbiased and
  non-negative, then clamped to ``±MAX_K3`` as verl does.

Why the clamps: one low-probability sampled token whose reference log-prob is 15 nats
above the policy's gives ``k3 = e¹⁵ ≈ 3.3e6``, which would dominate the clipped gradient
of the whole step (at 95 it is inf and the step is lost). With the clamps a token adds at
most ``MAX_K3`` (``k3``) or ``MAX_KL_LOG_RATIO`` (``k1``), ``MAX_KL_LOG_RATIO²/2``
(``k2``), and a clamped token gets no KL gradient (the penalty is saturated).

Example::

    kl = kl_penalty(logp, ref_logp, "k3")  # [B, T]
"""

from __future__ import annotations

from typing import Literal

import torch

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS = ("k1", "k2", "k3")
MAX_KL_LOG_RATIO = 20.0
"""The log-ratio reference/policy is clamped to this (verl's value) before any estimator."""
MAX_K3 = 10.0
"""``k3`` is clamped to ``±MAX_K3`` (verl's value)."""


def kl_penalty(
    logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator = "k3"
) -> torch.Tensor:
    """Per-token KL estimate of ``estimator`` (see the module docstring); same shape as
    ``logp``. ``logp`` carries the gradient; ``ref_logp`` is a constant."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator {estimator!r} is not one of {KL_ESTIMATORS}")
    x = (ref_logp.to(logp.dtype) - logp).clamp(-MAX_KL_LOG_RATIO, MAX_KL_LOG_RATIO)
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * x * x
    return (torch.exp(x) - x - 1.0).clamp(-MAX_K3, MAX_K3)
