"""The ``RewardFunction`` base class: score a list of completions, apply a weight.

Subclasses implement :meth:`RewardFunction.compute`. Calling an instance returns the
weighted scores; an exception inside ``compute`` is logged and counted, and every
completion scores 0.0 so one bad reward cannot crash the worker pool.

Example::

    @registry.register(name="shorter_is_better")
    class Shorter(RewardFunction):
        def compute(self, completions, **kwargs):
            return [1.0 / (1 + len(self.get_content(c))) for c in completions]
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any, Dict, List

logger = logging.getLogger(__name__)


class RewardFunction(ABC):
    """A weighted scoring function over a group of completions."""

    def __init__(self, weight: float = 1.0, name: str | None = None, **kwargs: Any) -> None:
        self.weight = float(weight)
        self._name = name
        self.config: Dict[str, Any] = kwargs
        self.wandb_logger: Any = None
        self.error_count = 0

    @property
    def name(self) -> str:
        """The name metrics are logged under: the one given, else the registry name, else
        the class name lower-cased."""
        return (
            self._name or getattr(type(self), "registry_name", None) or type(self).__name__.lower()
        )

    @name.setter
    def name(self, value: str | None) -> None:
        self._name = value

    @abstractmethod
    def compute(self, completions: List[Any], **kwargs: Any) -> List[float]:
        """Unweighted scores, one per completion."""

    def __call__(self, completions: List[Any], **kwargs: Any) -> List[float]:
        """Weighted scores, one per completion (0.0 each if ``compute`` raised)."""
        try:
            raw = self.compute(completions, **kwargs)
        except Exception:  # a reward must never take the worker down; logged and counted
            self.error_count += 1
            logger.exception(
                "reward %s failed; scoring %d completions 0.0", self.name, len(completions)
            )
            return [0.0] * len(completions)
        if len(raw) != len(completions):
            self.error_count += 1
            logger.error(
                "reward %s returned %d scores for %d completions; scoring 0.0",
                self.name,
                len(raw),
                len(completions),
            )
            return [0.0] * len(completions)
        weighted = [float(s) * self.weight for s in raw]
        if self.wandb_logger is not None:
            self.log_metrics(raw, weighted)
        return weighted

    def set_wandb_logger(self, logger: Any) -> None:
        """Log per-call statistics through ``logger.log(dict)`` (a W&B run or module)."""
        self.wandb_logger = logger

    def log_metrics(self, raw_rewards: List[float], weighted_rewards: List[float]) -> None:
        """Log the mean raw and weighted rewards under ``reward/{name}/...``."""
        if not raw_rewards or self.wandb_logger is None:
            return
        self.wandb_logger.log(
            {
                f"reward/{self.name}/mean_raw": sum(raw_rewards) / len(raw_rewards),
                f"reward/{self.name}/mean_weighted": sum(weighted_rewards) / len(weighted_rewards),
            }
        )

    @staticmethod
    def get_content(completion: Any) -> str:
        """The text of a completion given as a string, a message dict, a list of messages
        (the last one counts), an OpenAI choice (``.message.content`` or ``.text``) or a
        dict with ``message`` or ``text``."""
        if completion is None:
            return ""
        if isinstance(completion, str):
            return completion
        if isinstance(completion, dict):
            if "content" in completion:
                return _text_of(completion["content"])
            if "message" in completion:
                return RewardFunction.get_content(completion["message"])
            if "text" in completion:
                return str(completion["text"] or "")
            return ""
        if isinstance(completion, (list, tuple)):
            return RewardFunction.get_content(completion[-1]) if completion else ""
        message = getattr(completion, "message", None)
        if message is not None:
            return _text_of(getattr(message, "content", "") or "")
        if hasattr(completion, "content"):
            return _text_of(completion.content or "")
        if hasattr(completion, "text"):
            return str(completion.text or "")
        return str(completion)


def _text_of(content: Any) -> str:
    """Join the text parts of OpenAI content (string or list of parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def per_completion(value: Any, n: int, field: str) -> List[Any]:
    """Broadcast a scalar kwarg to ``n`` completions, or check a list has length ``n``."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{field} has {len(value)} entries for {n} completions")
        return list(value)
    return [value] * n


__all__ = ["RewardFunction", "per_completion"]
