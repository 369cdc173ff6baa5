"""``cosine_scaled``: correctness scaled by length on a cosine schedule.

Short correct answers earn the most; long wrong answers are penalised least (the
model is not pushed to give up early on hard problems).
"""

from __future__ import annotations

import math
from typing import Any, List

from atroposlib.envs.reward_fns.accuracy_reward import gold_from_kwargs
from atroposlib.envs.reward_fns.math_answers import verify_answer
from atroposlib.envs.reward_fns.registry import registry
from atroposlib.envs.reward_fns.reward_function import RewardFunction


def cosine_scale(length: int, max_len: int, min_value: float, max_value: float) -> float:
    """``min + (max-min) * (1 + cos(pi * min(length/max_len, 1))) / 2``: ``max`` at 0."""
    progress = min(max(length, 0) / max_len, 1.0)
    return min_value + 0.5 * (max_value - min_value) * (1.0 + math.cos(progress * math.pi))


@registry.register(name="cosine_scaled")
class CosineScaledReward(RewardFunction):
    """Correct: from ``max_value_correct`` (empty) down to ``min_value_correct``
    (``max_len``). Wrong: from ``min_value_wrong`` (empty) up to ``max_value_wrong``.

    Length is counted in tokens when a ``tokenizer`` is given, else in characters.
    """

    def __init__(
        self,
        min_value_wrong: float = -1.0,
        max_value_wrong: float = -0.5,
        min_value_correct: float = 0.5,
        max_value_correct: float = 1.0,
        max_len: int = 1000,
        tokenizer: Any | None = None,
        weight: float = 1.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(weight=weight, **kwargs)
        if max_len <= 0:
            raise ValueError("max_len must be > 0")
        self.min_value_wrong = min_value_wrong
        self.max_value_wrong = max_value_wrong
        self.min_value_correct = min_value_correct
        self.max_value_correct = max_value_correct
        self.max_len = max_len
        self.tokenizer = tokenizer

    def _length(self, text: str) -> int:
        if self.tokenizer is not None:
            return len(self.tokenizer.encode(text, add_special_tokens=False))
        return len(text)

    def compute(self, completions: List[Any], **kwargs: Any) -> List[float]:
        golds = gold_from_kwargs(kwargs, len(completions))
        scores = []
        for completion, gold in zip(completions, golds, strict=True):
            text = self.get_content(completion)
            correct = gold is not None and bool(verify_answer(text, str(gold)))
            if correct:
                lo, hi = self.min_value_correct, self.max_value_correct
            else:  # swapped: a longer wrong answer is penalised less
                lo, hi = self.max_value_wrong, self.min_value_wrong
            scores.append(cosine_scale(self._length(text), self.max_len, lo, hi))
        return scores


__all__ = ["CosineScaledReward", "cosine_scale"]
