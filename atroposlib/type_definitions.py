"""Shared type definitions: chat messages, items, agent/game histories and evaluation records.

These are plain ``TypedDict`` aliases so that environments can annotate their data without
pulling in any runtime machinery.
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, TypedDict, Union

from typing_extensions import NotRequired

ContentPart = Dict[str, Any]
"""One OpenAI-style content part, e.g. ``{"type": "text", "text": "hi"}``."""

Content = Union[str, List[ContentPart]]
"""Message content: a string or a list of content parts (text, image_url, ...)."""

Item = Any
"""Whatever an environment's ``get_next_item`` returns."""

UUID = str
"""Identifier of a running item in the worker pool."""

number = Union[int, float]


class Message(TypedDict):
    """One chat message; ``reward`` is optional per-message credit used by some environments."""

    role: Literal["system", "user", "assistant", "tool"]
    content: Content
    reward: NotRequired[float | None]


class AgentStep(TypedDict, total=False):
    """One step taken by an agent: what it saw, what it did, and what it earned."""

    step: int
    messages: List[Message]
    action: str
    observation: str
    reward: float
    done: bool
    info: Dict[str, Any]


AgentHistory = List[AgentStep]
"""The ordered steps of one agent trajectory."""

Observation = Any
"""An environment observation (text, dict, array, ...)."""


class GameStep(TypedDict, total=False):
    """One turn of a multi-agent or single-agent game."""

    step: int
    agent: str
    observation: Observation
    action: str
    reward: float
    done: bool
    info: Dict[str, Any]


GameHistory = List[GameStep]
"""The ordered turns of one game."""


class EvaluationConfigGeneral(TypedDict):
    """The ``config_general`` block of ``metrics.json``."""

    model_name: str
    total_evaluation_time_seconds: str
    generation_parameters: Dict[str, Any]


class EvaluationMetrics(TypedDict, total=False):
    """Named scalar metrics of one evaluation task (free-form keys)."""


EvaluationResults = Dict[str, Dict[str, Any]]
"""``{"atropos|task|0": metrics, "all": metrics}``."""


class EvaluationSample(TypedDict, total=False):
    """One evaluated example, written as a line of ``samples.jsonl``."""

    messages: List[Message]
    question: str
    gold_answer: Any
    model_answer: Any
    score: float
    correct: bool
    finish_reason: str


__all__ = [
    "AgentHistory",
    "AgentStep",
    "Content",
    "ContentPart",
    "EvaluationConfigGeneral",
    "EvaluationMetrics",
    "EvaluationResults",
    "EvaluationSample",
    "GameHistory",
    "GameStep",
    "Item",
    "Message",
    "Observation",
    "UUID",
    "number",
]
