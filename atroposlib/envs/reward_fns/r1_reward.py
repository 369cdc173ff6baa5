"""``r1``: DeepSeek-R1-style reward, strict format plus answer accuracy."""

from __future__ import annotations

import re
from typing import Any, Dict, List, Union

from atroposlib.envs.reward_fns.accuracy_reward import gold_from_kwargs
from atroposlib.envs.reward_fns.math_answers import verify_answer
from atroposlib.envs.reward_fns.registry import registry
from atroposlib.envs.reward_fns.reward_function import RewardFunction

_THINK_BLOCK = re.compile(r"<think>(.*?)</think>", re.DOTALL)
R1_FORMAT = re.compile(r"^\s*<think>(?!.*<think>).+?</think>\s*<answer>.+?</answer>\s*$", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def r1_format_ok(text: str) -> bool:
    """``<think>...</think>`` followed by ``<answer>...</answer>`` and nothing else."""
    return bool(R1_FORMAT.match(text))


def parse_reasoning_response(text: str) -> Dict[str, Any]:
    """Split a reasoning completion into its parts.

    Returns ``thinking`` (the text of the first ``<think>`` block, or None),
    ``thinking_blocks`` (how many closed blocks), ``response`` (the stripped text after the
    last ``</think>``, or the whole text without one; None when empty), ``answer`` (the
    ``<answer>`` block of the response when there is one, else the response) and
    ``unclosed_thinking`` (a ``<think>`` without its ``</think>``).
    """
    blocks = _THINK_BLOCK.findall(text)
    unclosed = text.count("<think>") > text.count("</think>")
    after = text.rsplit("</think>", 1)[-1] if "</think>" in text else ("" if unclosed else text)
    response = after.strip() or None
    match = _ANSWER.search(after)
    answer = match.group(1).strip() if match else response
    return {
        "thinking": blocks[0].strip() if blocks else None,
        "thinking_blocks": len(blocks),
        "response": response,
        "answer": answer,
        "unclosed_thinking": unclosed,
    }


@registry.register(name="format_reasoning")
class FormatReasoningReward(RewardFunction):
    """``reward_value`` (0.5) when the completion has the reasoning layout: a non-empty
    ``<think>`` block (``require_thinking``), only one (unless ``allow_multiple_thinking``),
    none left open, and a response after it (``require_response``); else 0.0."""

    def __init__(
        self,
        reward_value: float = 0.5,
        require_thinking: bool = True,
        require_response: bool = True,
        allow_multiple_thinking: bool = False,
        weight: float = 1.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(weight=weight, **kwargs)
        self.reward_value = reward_value
        self.require_thinking = require_thinking
        self.require_response = require_response
        self.allow_multiple_thinking = allow_multiple_thinking

    def _ok(self, text: str) -> bool:
        parts = parse_reasoning_response(text)
        if parts["unclosed_thinking"]:
            return False
        if self.require_thinking and not parts["thinking"]:
            return False
        if parts["thinking_blocks"] > 1 and not self.allow_multiple_thinking:
            return False
        return not (self.require_response and parts["response"] is None)

    def compute(self, completions: List[Any], **kwargs: Any) -> List[float]:
        return [self.reward_value if self._ok(self.get_content(c)) else 0.0 for c in completions]


@registry.register(name="accuracy_x")
class AccuracyXReward(RewardFunction):
    """``reward_value`` (1.0) when the response (after ``</think>``; its ``<answer>`` block
    when present) matches the ``solution``: equal text with ``exact_match`` (case-folded
    unless ``case_sensitive``), else the same mathematical answer or the solution appearing
    in the response."""

    def __init__(
        self,
        exact_match: bool = False,
        case_sensitive: bool = False,
        reward_value: float = 1.0,
        weight: float = 1.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(weight=weight, **kwargs)
        self.exact_match = exact_match
        self.case_sensitive = case_sensitive
        self.reward_value = reward_value

    def _matches(self, answer: str, gold: str) -> bool:
        fold = (lambda s: s) if self.case_sensitive else str.casefold
        if self.exact_match:
            return fold(answer.strip()) == fold(gold.strip())
        if verify_answer(answer, gold):
            return True
        return bool(gold.strip()) and fold(gold.strip()) in fold(answer)

    def compute(
        self,
        completions: List[Any],
        solution: Union[str, List[str], None] = None,
        **kwargs: Any,
    ) -> List[float]:
        golds = gold_from_kwargs({"solution": solution, **kwargs}, len(completions))
        scores = []
        for completion, gold in zip(completions, golds, strict=True):
            answer = parse_reasoning_response(self.get_content(completion))["answer"] or ""
            ok = gold is not None and self._matches(answer, str(gold))
            scores.append(self.reward_value if ok else 0.0)
        return scores


@registry.register(name="r1")
class R1Reward(RewardFunction):
    """``format_weight * format + accuracy_weight * accuracy`` (each 0 or 1).

    The answer checked is the ``<answer>`` block when present, else the text after
    ``</think>``. Needs the gold as ``solution``/``answer``.
    """

    def __init__(
        self,
        format_weight: float = 0.5,
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


def format_reasoning_reward(completions: List[Any], **kwargs: Any) -> List[float]:
    """Function form of :class:`FormatReasoningReward` (keywords go to its constructor)."""
    return FormatReasoningReward(**kwargs)(completions)


def accuracy_reward(
    completions: List[Any], solution: Union[str, List[str]], **kwargs: Any
) -> List[float]:
    """Function form of :class:`AccuracyXReward` against ``solution``."""
    return AccuracyXReward(**kwargs)(completions, solution=solution)


def r1_reward(
    completions: List[Any], solution: Union[str, List[str]], **kwargs: Any
) -> List[float]:
    """Function form of :class:`R1Reward` (keywords go to its constructor)."""
    return R1Reward(**kwargs)(completions, solution=solution)


__all__ = [
    "AccuracyXReward",
    "FormatReasoningReward",
    "R1Reward",
    "accuracy_reward",
    "format_reasoning_reward",
    "parse_reasoning_response",
    "r1_format_ok",
    "r1_reward",
]
