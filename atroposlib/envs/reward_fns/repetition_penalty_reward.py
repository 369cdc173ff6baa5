"""``repetition_penalty``: a negative reward for repeated word n-grams."""

from __future__ import annotations

from typing import Any, List

from atroposlib.envs.reward_fns.registry import registry
from atroposlib.envs.reward_fns.reward_function import RewardFunction


def repeated_ngram_fraction(text: str, ngram_size: int) -> float:
    """``1 - unique/total`` over the word n-grams of ``text`` (0.0 when too short)."""
    words = text.lower().split()
    if len(words) < ngram_size:
        return 0.0
    ngrams = [tuple(words[i : i + ngram_size]) for i in range(len(words) - ngram_size + 1)]
    return 1.0 - len(set(ngrams)) / len(ngrams)


@registry.register(name="repetition_penalty")
class RepetitionPenaltyReward(RewardFunction):
    """``max_penalty * repeated_ngram_fraction`` — 0.0 for no repetition, down to
    ``max_penalty`` (negative) for pure repetition."""

    def __init__(
        self, ngram_size: int = 3, max_penalty: float = -1.0, weight: float = 1.0, **kwargs: Any
    ) -> None:
        super().__init__(weight=weight, **kwargs)
        if max_penalty > 0:
            raise ValueError(f"max_penalty must be <= 0, got {max_penalty}")
        if ngram_size < 1:
            raise ValueError("ngram_size must be >= 1")
        self.ngram_size = ngram_size
        self.max_penalty = max_penalty

    def compute(self, completions: List[Any], **kwargs: Any) -> List[float]:
        return [
            self.max_penalty * repeated_ngram_fraction(self.get_content(c), self.ngram_size)
            for c in completions
        ]


def repetition_penalty_reward(
    completions: List[Any], threshold: float = 0.05, **kwargs: Any
) -> List[float]:
    """Function form of :class:`RepetitionPenaltyReward`: repetition fractions at or below
    ``threshold`` score 0.0 (no penalty); above it the penalty scales with the fraction."""
    reward = RepetitionPenaltyReward(**kwargs)
    return [
        0.0
        if repeated_ngram_fraction(reward.get_content(c), reward.ngram_size) <= threshold
        else score
        for c, score in zip(completions, reward(completions), strict=True)
    ]


__all__ = ["RepetitionPenaltyReward", "repeated_ngram_fraction", "repetition_penalty_reward"]
