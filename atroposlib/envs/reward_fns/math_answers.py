"""math-verify wrappers shared by the math rewards and the math environments.

The extraction settings follow the gsm8k environment (``equations`` normalisation is
off because current math-verify handles equations in the parser and warns otherwise): the gold is parsed from
``\\boxed{gold}``; the prediction is the first boxed/LaTeX answer in the text after the
last ``</think>``. math-verify uses ``signal.alarm`` for its timeouts, which only works
on the main thread, so the timeouts are disabled elsewhere.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any, List

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _math_verify() -> tuple[Any, Any, list, list]:
    """Import math-verify (and sympy under it) on first use: ``(parse, verify, pred, gold)``.

    The import costs more than a second, so ``import atroposlib.envs.reward_fns`` and the
    environments that never score math do not pay it; the first math reward called does.
    """
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    pred_config = [
        LatexExtractionConfig(
            normalization_config=NormalizationConfig(
                nits=False,
                malformed_operators=False,
                basic_latex=True,
                equations=False,
                boxed="all",
                units=True,
            ),
            boxed_match_priority=0,
            try_extract_without_anchor=False,
        )
    ]
    return parse, verify, pred_config, [LatexExtractionConfig()]


def _timeouts() -> dict:
    if threading.current_thread() is threading.main_thread():
        return {}
    return {"parsing_timeout": None}


def _verify_timeouts() -> dict:
    if threading.current_thread() is threading.main_thread():
        return {}
    return {"timeout_seconds": None}


def answer_after_think(text: str) -> str:
    """The part of ``text`` after the last ``</think>`` (all of it if there is none)."""
    return text.split("</think>")[-1]


def parse_gold(answer: str) -> List[Any]:
    """Parse a gold answer (plain or already boxed); an empty list means unparseable."""
    answer = str(answer).strip()
    boxed = answer if "\\boxed" in answer else "\\boxed{" + answer + "}"
    parse, _verify, _pred, gold_config = _math_verify()
    return parse(boxed, extraction_mode="first_match", extraction_config=gold_config, **_timeouts())


def parse_prediction(text: str) -> List[Any]:
    """Parse the model's final answer from the text after ``</think>``."""
    parse, _verify, pred_config, _gold = _math_verify()
    return parse(
        answer_after_think(text),
        extraction_config=pred_config,
        extraction_mode="first_match",
        **_timeouts(),
    )


def verify_parsed(gold_parsed: List[Any], pred_parsed: List[Any]) -> bool:
    """``math_verify.verify`` with timeouts that work off the main thread too."""
    if len(gold_parsed) == 0 or len(pred_parsed) == 0:
        return False
    verify = _math_verify()[1]
    return bool(verify(gold_parsed, pred_parsed, **_verify_timeouts()))


def verify_answer(text: str, gold: str) -> bool | None:
    """Whether ``text``'s answer equals ``gold``; ``None`` when the gold cannot be parsed."""
    gold_parsed = parse_gold(gold)
    if len(gold_parsed) == 0:
        return None
    return verify_parsed(gold_parsed, parse_prediction(text))


__all__ = ["answer_after_think", "parse_gold", "parse_prediction", "verify_answer", "verify_parsed"]
