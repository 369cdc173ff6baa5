"""``CombinedReward``: several rewards summed, optionally normalised."""

from __future__ import annotations

from typing import Any, List, Mapping, Sequence, Union

from atroposlib.envs.reward_fns.registry import registry
from atroposlib.envs.reward_fns.reward_function import RewardFunction

NORMALIZATIONS = ("none", "sum", "minmax")


@registry.register(name="combined")
class CombinedReward(RewardFunction):
    """Sum of the weighted scores of ``rewards`` (names, config dicts or instances).

    ``normalization``: ``"none"`` (plain sum), ``"sum"`` (divide by the total absolute
    weight, so the result is a weighted mean) or ``"minmax"`` (rescale the group's
    combined scores to [0, 1]; a constant group becomes all 0.0).

    Example::

        CombinedReward(rewards=[{"type": "accuracy", "weight": 1.0},
                                {"type": "format", "weight": 0.2}], normalization="sum")
    """

    def __init__(
        self,
        rewards: Sequence[Union[str, Mapping[str, Any], RewardFunction]],
        normalization: str = "none",
        weight: float = 1.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(weight=weight, **kwargs)
        if normalization not in NORMALIZATIONS:
            raise ValueError(
                f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}"
            )
        if not rewards:
            raise ValueError("CombinedReward needs at least one reward")
        self.normalization = normalization
        self.reward_functions: List[RewardFunction] = [
            r if isinstance(r, RewardFunction) else registry.create(r) for r in rewards
        ]

    def compute(self, completions: List[Any], **kwargs: Any) -> List[float]:
        combined = [0.0] * len(completions)
        for reward in self.reward_functions:
            for i, score in enumerate(reward(completions, **kwargs)):
                combined[i] += score
        if self.normalization == "sum":
            total = sum(abs(r.weight) for r in self.reward_functions)
            combined = [c / total for c in combined] if total > 0 else combined
        elif self.normalization == "minmax" and combined:
            lo, hi = min(combined), max(combined)
            combined = [(c - lo) / (hi - lo) if hi > lo else 0.0 for c in combined]
        return combined

    @property
    def name(self) -> str:
        """The given name, else ``combined(<part>,<part>...)``."""
        if self._name:
            return self._name
        return "combined(" + ",".join(r.name for r in self.reward_functions) + ")"

    @name.setter
    def name(self, value: str | None) -> None:
        self._name = value

    def set_wandb_logger(self, logger: Any) -> None:
        """Log through ``logger``, for this reward and every part."""
        super().set_wandb_logger(logger)
        for reward in self.reward_functions:
            reward.set_wandb_logger(logger)


__all__ = ["CombinedReward"]
