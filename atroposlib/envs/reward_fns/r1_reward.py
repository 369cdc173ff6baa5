"""``r1``: DeepSeek-R1-style reward, strict format plus answer accuracy."""

from __future__ import annotations

import re
from typing import Any, List

from atroposlib.envs.reward_fns.accuracy_reward import gold_from_kwargs
from atroposlib.envs.reward_fns.math_answers import verify_answer
from atroposlib.envs.reward_fns.registry import registry
from atroposlib.envs.reward_fns.reward_function import RewardFunction

R1_FORMAT = re.compile(r"^\s*<think>(?!.*<think>).+?</think>\s*<answer>.+?</answer>\s*$", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def r1_format_ok(text: str) -> bool:
    """``<think>...</think>`` followed by ``<answer>...</answer>`` and nothing else."""
    return bool(R1_FORMAT.match(text))


@registry.register(name="r1")
class R1Reward(RewardFunction):
    """``format_weight * format + accuracy_weight * accuracy`` (each 0 or 1).

    The answer checked is the ``<answer>`` block when present, else the text after
    ``</think>``. Needs the gold as ``solution``/``answer``.
    """

    def __init__(
        self,
        format_weight: float = 1.0,
        accuracy_weight: float = 1.0,
        weight: float = 1.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(weight=weight, **kwargs)
        self.format_weight = format_weight
        self.accuracy_weight = accuracy_weight

    def compute(self, completions: List[Any], **kwargs: Any) -> List[float]:
        golds = gold_from_kwargs(kwargs, len(completions))
        scores = []
        for completion, gold in zip(completions, golds, strict=True):
            text = self.get_content(completion)
            fmt = 1.0 if r1_format_ok(text) else 0.0
            match = _ANSWER.search(text.split("</think>")[-1])
            answer = match.group(1) if match else text
            acc = 1.0 if gold is not None and verify_answer(answer, str(gold)) else 0.0
            scores.append(self.format_weight * fmt + self.accuracy_weight * acc)
        return scores


__all__ = ["R1Reward", "r1_format_ok"]
