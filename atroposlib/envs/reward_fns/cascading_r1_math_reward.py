"""``cascading_r1_math``: format gates the answer check, stage by stage.

Stages: (1) a closed ``<think>`` block, (2) an extractable final answer after it,
(3) the answer is correct. A completion earns the score of the last stage it passes.
"""

from __future__ import annotations

from typing import Any, List, Union

from atroposlib.envs.reward_fns.accuracy_reward import gold_from_kwargs
from atroposlib.envs.reward_fns.math_answers import parse_prediction, verify_answer
from atroposlib.envs.reward_fns.registry import registry
from atroposlib.envs.reward_fns.reward_function import RewardFunction


def think_closed_once(text: str) -> bool:
    """Exactly one ``</think>``, at most one ``<think>`` before it."""
    if text.count("</think>") != 1 or text.count("<think>") > 1:
        return False
    return text.find("<think>") < text.find("</think>")


@registry.register(name="cascading_r1_math")
class CascadingR1MathReward(RewardFunction):
    """``malformed_score`` (0.0) < ``formatted_score`` (0.1) < ``answered_score``
    (0.2) < ``correct_score`` (1.0). Needs the gold as ``solution``/``answer``."""

    def __init__(
        self,
        malformed_score: float = 0.0,
        formatted_score: float = 0.1,
        answered_score: float = 0.2,
        correct_score: float = 1.0,
        weight: float = 1.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(weight=weight, **kwargs)
        self.malformed_score = malformed_score
        self.formatted_score = formatted_score
        self.answered_score = answered_score
        self.correct_score = correct_score

    def compute(self, completions: List[Any], **kwargs: Any) -> List[float]:
        golds = gold_from_kwargs(kwargs, len(completions))
        scores = []
        for completion, gold in zip(completions, golds, strict=True):
            text = self.get_content(completion)
            if not think_closed_once(text):
                scores.append(self.malformed_score)
            elif len(parse_prediction(text)) == 0:
                scores.append(self.formatted_score)
            elif gold is not None and verify_answer(text, str(gold)):
                scores.append(self.correct_score)
            else:
                scores.append(self.answered_score)
        return scores


def get_completion_content(completion: Any) -> str:
    """The text of a completion in any of the shapes rewards accept."""
    return RewardFunction.get_content(completion)


def format_reward(completions: List[Any], reward_value: float = 0.5, **kwargs: Any) -> List[float]:
    """``reward_value`` for each completion with one closed ``<think>`` block, else 0.0."""
    return [
        reward_value if think_closed_once(get_completion_content(c)) else 0.0 for c in completions
    ]


def accuracy_reward(
    completions: List[Any], solution: Union[str, List[str]], **kwargs: Any
) -> List[float]:
    """1.0 for each completion whose final answer matches ``solution``, else 0.0."""
    golds = gold_from_kwargs({"solution": solution}, len(completions))
    return [
        1.0 if gold is not None and verify_answer(get_completion_content(c), str(gold)) else 0.0
        for c, gold in zip(completions, golds, strict=True)
    ]


def cascading_r1_math_reward(
    completions: List[Any], solution: Union[str, List[str]], **kwargs: Any
) -> List[float]:
    """Function form of :class:`CascadingR1MathReward` (keywords go to its constructor)."""
    return CascadingR1MathReward(**kwargs)(completions, solution=solution)


__all__ = [
    "CascadingR1MathReward",
    "accuracy_reward",
    "cascading_r1_math_reward",
    "format_reward",
    "get_completion_content",
    "think_closed_once",
]
