"""``accuracy``: 1.0 when the completion's final answer equals the gold (math-verify)."""

from __future__ import annotations

import logging
from typing import Any, List, Union

from atroposlib.envs.reward_fns.math_answers import verify_answer
from atroposlib.envs.reward_fns.registry import registry
from atroposlib.envs.reward_fns.reward_function import RewardFunction, per_completion

logger = logging.getLogger(__name__)


def gold_from_kwargs(kwargs: dict, n: int) -> List[str | None]:
    """The gold answers passed as ``solution``, ``ground_truth``, ``answer`` or ``gold``
    (scalar or list)."""
    for key in ("solution", "ground_truth", "answer", "gold", "gold_answer"):
        if kwargs.get(key) is not None:
            return per_completion(kwargs[key], n, key)
    raise ValueError("accuracy reward needs a 'solution' (or 'answer'/'gold') keyword")


@registry.register(name="accuracy")
class AccuracyReward(RewardFunction):
    """Correctness of the final answer.

    The answer is parsed from the text after the last ``</think>`` (a ``\\boxed{}`` is
    preferred); the gold may be plain (``"72"``) or boxed. Scores ``correct_score``
    (1.0) or ``incorrect_score`` (0.0). An unparseable gold scores ``incorrect_score``
    and is logged.
    """

    def __init__(
        self,
        correct_score: float = 1.0,
        incorrect_score: float = 0.0,
        weight: float = 1.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(weight=weight, **kwargs)
        self.correct_score = correct_score
        self.incorrect_score = incorrect_score

    def compute(self, completions: List[Any], **kwargs: Any) -> List[float]:
        golds = gold_from_kwargs(kwargs, len(completions))
        scores = []
        for completion, gold in zip(completions, golds, strict=True):
            ok = (
                verify_answer(self.get_content(completion), str(gold)) if gold is not None else None
            )
            if ok is None:
                logger.warning("accuracy: gold answer %r cannot be parsed", gold)
            scores.append(self.correct_score if ok else self.incorrect_score)
        return scores


def accuracy_reward(
    completions: List[Any],
    solution: Union[str, List[str]] = None,
    ground_truth: Union[str, List[str]] = None,
    **kwargs: Any,
) -> List[float]:
    """Function form: :class:`AccuracyReward` scores against ``solution`` (or
    ``ground_truth``)."""
    gold = solution if solution is not None else ground_truth
    return AccuracyReward()(completions, solution=gold, **kwargs)


__all__ = ["AccuracyReward", "accuracy_reward", "gold_from_kwargs"]
