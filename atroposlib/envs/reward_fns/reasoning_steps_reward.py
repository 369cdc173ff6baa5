"""``reasoning_steps``: rewards visible step-by-step reasoning."""

from __future__ import annotations

import re
from typing import Any, List

from atroposlib.envs.reward_fns.registry import registry
from atroposlib.envs.reward_fns.reward_function import RewardFunction

STEP_PATTERN = re.compile(
    r"(?:^|\n)\s*(?:step\s*\d+\s*[:.)]|\d+[.)]\s|[-*•]\s)|\b(?:first|second|third|next|then|finally)\s*,",
    re.IGNORECASE,
)


@registry.register(name="reasoning_steps")
class ReasoningStepsReward(RewardFunction):
    """``min(1, steps / min_steps)`` where steps counts "Step n:", numbered or bulleted
    lines and "First,/Next,/Finally," markers."""

    def __init__(self, min_steps: int = 3, weight: float = 1.0, **kwargs: Any) -> None:
        super().__init__(weight=weight, **kwargs)
        if min_steps < 1:
            raise ValueError("min_steps must be >= 1")
        self.min_steps = min_steps

    def compute(self, completions: List[Any], **kwargs: Any) -> List[float]:
        return [
            min(1.0, len(STEP_PATTERN.findall(self.get_content(c))) / self.min_steps)
            for c in completions
        ]


def reasoning_steps_reward(completions: List[Any], **kwargs: Any) -> List[float]:
    """Function form of :class:`ReasoningStepsReward` (keywords go to its constructor)."""
    return ReasoningStepsReward(**kwargs)(completions)


__all__ = ["ReasoningStepsReward", "STEP_PATTERN", "reasoning_steps_reward"]
