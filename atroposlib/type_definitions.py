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


class Observation(TypedDict):
    """What an agent observes: the raw state and the content it is shown."""

    raw: Dict[str, Any]
    rendered: Content


class GameStep(TypedDict):
    """One turn of a multi-agent or single-agent game."""

    step: int
    agent_id: str
    observation: Observation
    action: str
    reward: float | Dict[str, float]
    done: bool
    info: Dict[str, Any]


GameHistory = List[GameStep]
"""The ordered turns of one game."""


class EvaluationConfigGeneral(TypedDict):
    """The ``config_general`` block of ``metrics.json``."""

    total_evaluation_time_seconds: str
    model_name: str | None
    generation_parameters: Dict[str, Any]


class EvaluationResults(TypedDict):
    """The ``results`` block of ``metrics.json``: ``all`` holds every metric of the run
    (the per-task entry, ``atropos|<task>|0``, repeats them)."""

    all: Dict[str, float]


class EvaluationMetrics(TypedDict):
    """The whole ``metrics.json`` of an evaluation."""

    config_general: EvaluationConfigGeneral
    results: EvaluationResults


class EvaluationSample(TypedDict, total=False):
    """One evaluated example, written as a line of ``samples.jsonl``."""

    messages: List[Dict[str, str]] | None
    question: str | None
    gold_answer: str | None
    gold_parsed: str | None
    model_parsed: str | None
    model_answer: Any
    score: int | None
    correct: bool | None
    finish_reason: str | None
    response_after_think: str | None


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
