"""Scoring the policy through the inference server at chosen points of a run.

The eval function comes from the environment (``EvalSection.function``) and is
called as ``fn(base_url, tokenizer) → score in [0, 1]``; every call is recorded with
its label (before / during / after), trainer step and duration.

A function may describe what it scores with an ``eval_set`` attribute, e.g.
``{"held_out": True, "size": 200, "train_size": 9800}``: the summary records it,
so a reader can tell generalisation from fit, and ``size`` sets the number of
trials behind each score's confidence interval.

A function with a ``model`` parameter is also given :attr:`Evaluator.served_model`, the model
name that samples the policy being trained, once it is not the server's default (the LoRA
adapter vLLM serves in ``lora_only``, see :mod:`..vllm_integration.lora`); without one it scores whatever
the server answers for requests that name no model.
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import Any, Dict, List

from ..plugins import load_function
from .run_config import EvalSection

logger = logging.getLogger(__name__)


class Evaluator:
    """Runs the configured eval function and keeps the scores (nothing when unconfigured)."""

    def __init__(self, section: EvalSection | None, inference_url: str) -> None:
        self.section = section
        self.url = inference_url
        self.evals: List[Dict[str, Any]] = []
        self.eval_set: Dict[str, Any] | None = None
        self._tokenizers: Dict[str, Any] = {}
        self.served_model: str | None = None
        """The model name to request (None: the server's default model)."""
        self._warned = False

    @property
    def every_steps(self) -> int:
        """Evaluate during training every this many trainer steps (0 = never)."""
        return self.section.every_steps if self.section else 0

    def evaluate(self, label: str, step: int, model: str) -> float | None:
        """Score the weights the inference server holds now; None when no eval is configured."""
        if self.section is None:
            return None
        if model not in self._tokenizers:
            from transformers import AutoTokenizer

            self._tokenizers[model] = AutoTokenizer.from_pretrained(model)
        fn = load_function(self.section.function)
        described = getattr(fn, "eval_set", None)
        self.eval_set = dict(described) if isinstance(described, dict) else None
        kwargs: Dict[str, Any] = {}
        if self.served_model is not None and takes_model(fn):
            kwargs["model"] = self.served_model
        elif self.served_model is not None and not self._warned:
            self._warned = True
            logger.warning(
                "eval function %s takes no model argument: it scores the server's default "
                "model, not %r",
                self.section.function,
                self.served_model,
            )
        t = time.time()
        score = float(fn(self.url, self._tokenizers[model], **kwargs))
        record: Dict[str, Any] = {
            "label": label,
            "step": step,
            "score": score,
            "seconds": time.time() - t,
        }
        if self.eval_set and self.eval_set.get("size"):
            record["n"] = int(self.eval_set["size"])
        self.evals.append(record)
        logger.info("eval %s (step %d): %.3f", label, step, score)
        return score


def takes_model(fn: Any) -> bool:
    """Whether the eval function has a ``model`` parameter (the model name to request)."""
    try:
        return "model" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
