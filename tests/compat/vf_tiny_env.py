"""A small verifiers environment the drop-in tests load by module name.

``vf.load_environment("vf-tiny-env")`` imports the module ``vf_tiny_env`` (verifiers 0.1.9
turns the id's dashes into underscores and keeps the part after the last ``/``), so a
process whose ``PYTHONPATH`` holds this folder can load it as an installed environment.

The tasks are single-turn chat prompts; the rubric has one reward, ``letter_share``: the
share of the answer's characters that are ASCII letters. Any text gets a score (the tiny
model answers with arbitrary tokens), and different texts almost always get different
scores, so a score paired with the wrong rollout shows.
"""

from __future__ import annotations

import string
from typing import Any

import verifiers as vf
from datasets import Dataset

SYSTEM_PROMPT = "Answer with one short English word."
QUESTIONS = [
    ("Name a colour.", "red"),
    ("Name an animal.", "cat"),
    ("Name a fruit.", "apple"),
]
_LETTERS = frozenset(string.ascii_letters)


def score_text(text: str) -> float:
    """The reward of an answer ``text``: the share of its characters that are ASCII letters
    (0.0 for an empty answer)."""
    if not text:
        return 0.0
    return sum(ch in _LETTERS for ch in text) / len(text)


def letter_share(completion: Any, **_: Any) -> float:
    """Rubric reward: ``score_text`` of the last assistant message (or of the text, for a
    completion-style rollout)."""
    if isinstance(completion, str):
        return score_text(completion)
    answers = [m for m in completion or [] if m.get("role") == "assistant"]
    return score_text((answers[-1].get("content") or "") if answers else "")


def load_environment(**_: Any) -> vf.Environment:
    """The environment ``vf.load_environment`` builds: a ``SingleTurnEnv`` over
    ``QUESTIONS`` scored by ``letter_share``."""
    dataset = Dataset.from_list([{"question": q, "answer": a} for q, a in QUESTIONS])
    rubric = vf.Rubric(funcs=[letter_share], weights=[1.0])
    return vf.SingleTurnEnv(dataset=dataset, system_prompt=SYSTEM_PROMPT, rubric=rubric)
