"""Threshold length penalty: once every rollout of a group is correct, prefer shorter ones.

Lengths up to ``threshold_ratio * max_token_length`` keep their score; above it the
score falls linearly to 0 at ``max_token_length`` (the gsm8k environment's rule).

Example::

    calc = ThresholdLengthPenaltyCalculator(ThresholdLengthPenaltyConfig(max_token_length=100))
    calc.apply_length_penalties([1.0, 1.0], [40, 75])  # -> [1.0, 0.5]
"""

from __future__ import annotations

from typing import List, Sequence

from pydantic import BaseModel, Field, model_validator


class ThresholdLengthPenaltyConfig(BaseModel):
    """Settings of the threshold length penalty."""

    max_token_length: int = Field(
        2048, gt=0, description="Length at which the penalised score reaches 0."
    )
    threshold_ratio: float = Field(
        0.5,
        ge=0.0,
        lt=1.0,
        description="Fraction of max_token_length below which no penalty applies.",
    )
    only_when_all_correct: bool = Field(
        True, description="Apply only when every score is >= correct_threshold."
    )
    correct_threshold: float = Field(1.0, description="A score at or above this counts as correct.")

    @model_validator(mode="after")
    def _threshold_below_max(self) -> ThresholdLengthPenaltyConfig:
        if int(self.max_token_length * self.threshold_ratio) >= self.max_token_length:
            raise ValueError("threshold must be below max_token_length")
        return self


def length_penalty_factor(
    length: int, max_token_length: int, threshold_ratio: float = 0.5
) -> float:
    """1.0 up to the threshold, then ``1 - (len - thr) / (max - thr)``, clamped to [0, 1]."""
    threshold = max_token_length * threshold_ratio
    if length <= threshold:
        return 1.0
    fraction = min((length - threshold) / (max_token_length - threshold), 1.0)
    return 1.0 - fraction


class ThresholdLengthPenaltyCalculator:
    """Applies :func:`length_penalty_factor` to a group's scores."""

    def __init__(self, config: ThresholdLengthPenaltyConfig | None = None) -> None:
        self.config = config or ThresholdLengthPenaltyConfig()

    def apply_length_penalties(
        self, scores: Sequence[float], lengths: Sequence[int]
    ) -> List[float]:
        """Penalised scores (``score * factor``), or the scores unchanged when the group
        is not all correct and ``only_when_all_correct`` is set.

        Raises:
            ValueError: when the lists differ in length.
        """
        if len(scores) != len(lengths):
            raise ValueError(f"{len(scores)} scores but {len(lengths)} lengths")
        cfg = self.config
        if cfg.only_when_all_correct and not all(s >= cfg.correct_threshold for s in scores):
            return [float(s) for s in scores]
        return [
            float(s) * length_penalty_factor(n, cfg.max_token_length, cfg.threshold_ratio)
            for s, n in zip(scores, lengths, strict=True)
        ]


__all__ = [
    "ThresholdLengthPenaltyCalculator",
    "ThresholdLengthPenaltyConfig",
    "length_penalty_factor",
]
