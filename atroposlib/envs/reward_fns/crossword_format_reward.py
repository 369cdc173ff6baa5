"""``crossword_format``: are crossword answers given as ``<n> Across|Down: WORD`` lines?"""

from __future__ import annotations

import re
from typing import Any, Dict, List

from atroposlib.envs.reward_fns.registry import registry
from atroposlib.envs.reward_fns.reward_function import RewardFunction

ANSWER_LINE = re.compile(
    r"^\s*(\d+)\s*[-\s]?\s*(across|down|a|d)\s*[:=]\s*([A-Za-z]+)\s*$", re.IGNORECASE
)


def parse_crossword_answers(text: str) -> Dict[str, str]:
    """``{"1-Across": "WORD", ...}`` from well-formed lines of ``text``."""
    answers: Dict[str, str] = {}
    for line in text.splitlines():
        match = ANSWER_LINE.match(line)
        if match:
            number, direction, word = match.groups()
            direction = "Across" if direction.lower().startswith("a") else "Down"
            answers[f"{number}-{direction}"] = word.upper()
    return answers


@registry.register(name="crossword_format")
class CrosswordFormatReward(RewardFunction):
    """Fraction of non-empty answer lines (after ``</think>``) that are well formed.

    With ``expected_lengths={"1-Across": 5, ...}`` (per call or in the config), the
    score is instead the fraction of expected clues answered with a word of the right
    length. Empty output scores 0.0.
    """

    def __init__(
        self, expected_lengths: Dict[str, int] | None = None, weight: float = 1.0, **kwargs: Any
    ) -> None:
        super().__init__(weight=weight, **kwargs)
        self.expected_lengths = expected_lengths

    def compute(
        self, completions: List[Any], expected_lengths: Dict[str, int] | None = None, **kwargs: Any
    ) -> List[float]:
        expected = expected_lengths or self.expected_lengths
        scores = []
        for completion in completions:
            text = self.get_content(completion).split("</think>")[-1]
            lines = [ln for ln in text.splitlines() if ln.strip()]
            if not lines:
                scores.append(0.0)
                continue
            answers = parse_crossword_answers(text)
            if expected:
                good = sum(1 for clue, n in expected.items() if len(answers.get(clue, "")) == n)
                scores.append(good / len(expected))
            else:
                scores.append(sum(1 for ln in lines if ANSWER_LINE.match(ln)) / len(lines))
        return scores


def crossword_format_reward(completions: List[Any], **kwargs: Any) -> List[float]:
    """Function form of :class:`CrosswordFormatReward` (``expected_lengths`` per call)."""
    return CrosswordFormatReward()(completions, **kwargs)


__all__ = [
    "ANSWER_LINE",
    "CrosswordFormatReward",
    "crossword_format_reward",
    "parse_crossword_answers",
]
