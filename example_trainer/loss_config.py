"""What the loss is asked to do: one object built from the trainer's flags.

:class:`LossConfig` gathers every loss option (clip ranges, KL, importance-sampling level,
off-policy correction, aggregation, entropy, distillation); the trainer builds it once from
its :class:`~example_trainer.config.TrainingConfig` and passes it to
:func:`~example_trainer.training.grpo_loss` (or, from log-probs,
:func:`~example_trainer.loss.compute_loss`) with every micro-batch. A new loss term adds its
fields here and reads them in :mod:`example_trainer.loss`; nothing else in the loop changes.

Example::

    loss_cfg = LossConfig.from_training(config)  # or LossConfig(clip_eps_high=0.28)
    out = grpo_loss(logits, labels, adv, temps, inference_lp, loss_cfg, normalizer=n)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .kl import KL_ESTIMATORS
from .off_policy import CorrectionConfig

IS_LEVELS = ("token", "sequence")
LOSS_TYPES = ("token-mean", "grpo", "dr_grpo", "seq-mean-token-sum")


@dataclass(frozen=True)
class LossConfig:
    """The loss options of one run (see ``atropos-grpo --help`` for each)."""

    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    clip_ratio_c: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_in_reward: bool = False
    importance_sampling_level: str = "token"
    off_policy: CorrectionConfig = field(default_factory=CorrectionConfig)
    loss_type: str = "token-mean"
    entropy_coef: float = 0.0
    log_entropy: bool = False
    distill_coef: float = 0.0  # 0: no distillation term
    distill_temperature: float = 1.0
    distill_only: bool = False

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type {self.loss_type!r} is not one of {LOSS_TYPES}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator {self.kl_estimator!r} is not one of {KL_ESTIMATORS}")
        if self.importance_sampling_level not in IS_LEVELS:
            raise ValueError(
                f"importance_sampling_level {self.importance_sampling_level!r} is not one of {IS_LEVELS}"
            )

    @classmethod
    def from_training(cls, cfg: Any) -> LossConfig:
        """The loss options of a :class:`~example_trainer.config.TrainingConfig`."""
        return cls(
            clip_eps=cfg.clip_eps,
            clip_eps_high=cfg.clip_eps_high,
            clip_ratio_c=cfg.clip_ratio_c,
            kl_coef=cfg.kl_coef,
            kl_estimator=cfg.kl_estimator,
            kl_in_reward=cfg.kl_in_reward,
            importance_sampling_level=cfg.importance_sampling_level,
            off_policy=CorrectionConfig(
                cfg.off_policy_correction,
                cfg.off_policy_clip,
                cfg.off_policy_clip_low,
                cfg.tis_mode,
            ),
            loss_type=cfg.loss_type,
            entropy_coef=cfg.entropy_coef,
            log_entropy=cfg.log_entropy,
            distill_coef=cfg.distill_coef if cfg.distill_enabled else 0.0,
            distill_temperature=cfg.distill_temperature,
            distill_only=cfg.distill_only,
        )

    @property
    def needs_reference(self) -> bool:
        """Whether a reference policy's log-probs are needed (a KL term, in the loss or
        in the reward)."""
        return self.kl_coef > 0

    @property
    def loss_kl_coef(self) -> float:
        """The weight of the KL term in the loss: ``kl_coef``, or 0 with ``kl_in_reward`` (the
        KL is then in the advantages already; the loss still logs ``train/kl``)."""
        return 0.0 if self.kl_in_reward else self.kl_coef
