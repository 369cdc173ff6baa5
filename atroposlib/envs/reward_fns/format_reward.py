"""``format``: 1.0 when the completion wraps its parts in the expected tags."""

from __future__ import annotations

import re
from typing import Any, List, Sequence

from atroposlib.envs.reward_fns.registry import registry
from atroposlib.envs.reward_fns.reward_function import RewardFunction


@registry.register(name="format")
class FormatReward(RewardFunction):
    """Checks for non-empty ``<tag>...</tag>`` blocks.

    ``preferred_tags`` defaults to ``["think", "answer"]``. With ``require_all_tags``
    every tag must appear exactly once; otherwise (the default) one is enough. Scores
    1.0 or 0.0.
    """

    def __init__(
        self,
        preferred_tags: Sequence[str] | None = None,
        require_all_tags: bool = False,
        case_sensitive: bool = False,
        weight: float = 1.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(weight=weight, **kwargs)
        self.preferred_tags = list(preferred_tags or ["think", "answer"])
        self.require_all_tags = require_all_tags
        self.flags = re.DOTALL | (0 if case_sensitive else re.IGNORECASE)

    def _tag_ok(self, text: str, tag: str) -> bool:
        t = re.escape(tag)
        blocks = re.findall(rf"<{t}>(.*?)</{t}>", text, self.flags)
        return len(blocks) == 1 and blocks[0].strip() != ""

    def compute(self, completions: List[Any], **kwargs: Any) -> List[float]:
        scores = []
        for completion in completions:
            text = self.get_content(completion)
            found = [self._tag_ok(text, tag) for tag in self.preferred_tags]
            ok = all(found) if self.require_all_tags else any(found)
            scores.append(1.0 if ok else 0.0)
        return scores


def format_reward(
    completions: List[Any], preferred_tags: Sequence[str] | None = None, **kwargs: Any
) -> List[float]:
    """Function form: :class:`FormatReward` with these ``preferred_tags`` (and any other
    constructor keyword)."""
    return FormatReward(preferred_tags=preferred_tags, **kwargs)(completions)


__all__ = ["FormatReward", "format_reward"]
