"""``cosine_scaled``: correctness scaled by length on a cosine schedule, or the cosine
similarity of the completion's embedding to the solution's.

Length mode (the default): short correct answers earn the most; long wrong answers are
penalised least (the model is not pushed to give up early on hard problems).

Similarity mode (the original's arguments: ``model_name``, ``scale_factor``, ``min_reward``,
``max_reward``, ``default_reward``): the mean-pooled embeddings of completion and solution
from a sentence encoder (``sentence-transformers/all-MiniLM-L6-v2`` unless ``model_name``),
their cosine similarity times ``scale_factor``, clipped to ``[min_reward, max_reward]``.
"""

from __future__ import annotations

import logging
import math
from typing import Any, List, Union

from atroposlib.envs.reward_fns.accuracy_reward import gold_from_kwargs
from atroposlib.envs.reward_fns.math_answers import verify_answer
from atroposlib.envs.reward_fns.registry import registry
from atroposlib.envs.reward_fns.reward_function import RewardFunction

logger = logging.getLogger(__name__)


def cosine_scale(length: int, max_len: int, min_value: float, max_value: float) -> float:
    """``min + (max-min) * (1 + cos(pi * min(length/max_len, 1))) / 2``: ``max`` at 0."""
    progress = min(max(length, 0) / max_len, 1.0)
    return min_value + 0.5 * (max_value - min_value) * (1.0 + math.cos(progress * math.pi))


_SIMILARITY_ARGS = ("model_name", "scale_factor", "min_reward", "max_reward", "default_reward")


@registry.register(name="cosine_scaled")
class CosineScaledReward(RewardFunction):
    """Length mode: correct from ``max_value_correct`` (empty) down to
    ``min_value_correct`` (``max_len``), wrong from ``min_value_wrong`` (empty) up to
    ``max_value_wrong``; length in tokens when a ``tokenizer`` is given, else characters.

    Similarity mode (any of the original's ``model_name``, ``scale_factor``,
    ``min_reward``, ``max_reward``, ``default_reward`` given): see the module doc. The
    encoder is loaded once per process and shared (``_model``/``_tokenizer``); a
    completion without a solution, or any failure, scores ``default_reward``.
    """

    _model = None
    _tokenizer = None
    _model_name = "sentence-transformers/all-MiniLM-L6-v2"

    def __init__(
        self,
        model_name: str | None = None,
        scale_factor: float = 1.0,
        min_reward: float = -1.0,
        max_reward: float = 1.0,
        default_reward: float = 0.0,
        weight: float = 1.0,
        *,
        min_value_wrong: float = -1.0,
        max_value_wrong: float = -0.5,
        min_value_correct: float = 0.5,
        max_value_correct: float = 1.0,
        max_len: int = 1000,
        tokenizer: Any | None = None,
        **kwargs: Any,
    ) -> None:
        given = {k for k in _SIMILARITY_ARGS if k in kwargs}
        self.similarity_mode = bool(given) or model_name is not None
        for key in given:  # passed by name through **kwargs by registry configs
            value = kwargs.pop(key)
            if key == "model_name":
                model_name = value
            elif key == "scale_factor":
                scale_factor = value
            elif key == "min_reward":
                min_reward = value
            elif key == "max_reward":
                max_reward = value
            else:
                default_reward = value
        super().__init__(weight=weight, **kwargs)
        if max_len <= 0:
            raise ValueError("max_len must be > 0")
        self.model_name = model_name or type(self)._model_name
        self.scale_factor = float(scale_factor)
        self.min_reward = float(min_reward)
        self.max_reward = float(max_reward)
        self.default_reward = float(default_reward)
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

    def _ensure_model_loaded(self) -> None:
        """Load the sentence encoder (``model_name``) once per process, shared by every
        instance that names the same model."""
        cls = type(self)
        if cls._model is not None and cls._model_name == self.model_name:
            return
        from transformers import AutoModel, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.model_name)
        model = AutoModel.from_pretrained(self.model_name)
        model.eval()
        cls._tokenizer, cls._model, cls._model_name = tokenizer, model, self.model_name

    def _mean_pooling(self, model_output: Any, attention_mask: Any) -> Any:
        """The mean of the token embeddings over the real (unmasked) tokens."""
        embeddings = model_output[0]
        mask = attention_mask.unsqueeze(-1).expand(embeddings.size()).to(embeddings.dtype)
        return (embeddings * mask).sum(1) / mask.sum(1).clamp(min=1e-9)

    def _get_embeddings(self, text: Union[str, List[str]]) -> Any:
        """Unit-length sentence embeddings of ``text`` (one row per string)."""
        import torch

        self._ensure_model_loaded()
        cls = type(self)
        texts = [text] if isinstance(text, str) else list(text)
        encoded = cls._tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
        with torch.no_grad():
            output = cls._model(**encoded)
        pooled = self._mean_pooling(output, encoded["attention_mask"])
        return torch.nn.functional.normalize(pooled, p=2, dim=1)

    def _similarity_scores(self, completions: List[Any], golds: List[Any]) -> List[float]:
        scores = []
        for completion, gold in zip(completions, golds, strict=True):
            text = self.get_content(completion)
            if gold is None or not text.strip() or not str(gold).strip():
                scores.append(self.default_reward)
                continue
            try:
                pair = self._get_embeddings([text, str(gold)])
                similarity = float((pair[0] * pair[1]).sum())
            except Exception as err:  # noqa: BLE001 - a missing encoder scores the default
                logger.warning("cosine_scaled: embedding failed (%s); default reward", err)
                scores.append(self.default_reward)
                continue
            value = similarity * self.scale_factor
            scores.append(max(self.min_reward, min(self.max_reward, value)))
        return scores

    def compute(
        self,
        completions: List[Any],
        solution: Union[str, List[str]] | None = None,
        **kwargs: Any,
    ) -> List[float]:
        if solution is not None:
            kwargs["solution"] = solution
        if self.similarity_mode:
            try:
                golds = gold_from_kwargs(kwargs, len(completions))
            except ValueError:
                golds = [None] * len(completions)
            return self._similarity_scores(completions, golds)
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


def cosine_scaled_reward(
    completions: List[Any], solution: Any = None, **kwargs: Any
) -> List[float]:
    """Function form of :class:`CosineScaledReward` (constructor keywords accepted)."""
    call = {k: kwargs.pop(k) for k in ("answer", "gold", "ground_truth") if k in kwargs}
    return CosineScaledReward(**kwargs)(completions, solution=solution, **call)


__all__ = ["CosineScaledReward", "cosine_scale", "cosine_scaled_reward"]
