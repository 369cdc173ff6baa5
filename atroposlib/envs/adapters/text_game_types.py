"""The types of a text game: a turn, a step's result, the game interfaces, and the two
exceptions that end an episode early (see :mod:`~atroposlib.envs.adapters.text_games`,
which re-exports them, for the loop that plays one). A leaf: the worker-process runner
(:mod:`~atroposlib.envs.adapters.game_worker`) and the loop both build on it."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Dict

__all__ = [
    "AsyncTextGame",
    "EpisodeEnded",
    "GameStepTimeout",
    "StepResult",
    "TextGame",
    "Turn",
]


@dataclass
class Turn:
    """Whose move it is and the observation they are shown."""

    player: int
    observation: str


@dataclass
class StepResult:
    """What a step did: the next turn (None when done), final rewards (when done)."""

    turn: Turn | None
    done: bool
    rewards: Dict[int, float] = field(default_factory=dict)


class TextGame(abc.ABC):
    """A text game for one or more players. Implementations may block: :func:`play_episode`
    runs them in a worker process, so they should pickle (a module-level class)."""

    num_players: int = 1

    @abc.abstractmethod
    def reset(self, seed: int) -> Turn:
        """Start a new game from ``seed``; the first turn."""

    @abc.abstractmethod
    def step(self, text: str) -> StepResult:
        """Play the current player's move ``text``."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the game holds."""


class AsyncTextGame(abc.ABC):
    """A text game whose calls are awaited; a cancelled call must leave nothing running
    (``play_episode`` cancels one at its time limit)."""

    num_players: int = 1

    @abc.abstractmethod
    async def reset(self, seed: int) -> Turn:
        """Start a new game from ``seed``; the first turn."""

    @abc.abstractmethod
    async def step(self, text: str) -> StepResult:
        """Play the current player's move ``text``."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the game holds."""


class EpisodeEnded(Exception):
    """Raised by a player that cannot move (say, its server is down): the episode ends
    with ``reason`` as its ``end_reason`` and the message logged."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class GameStepTimeout(Exception):
    """Raised inside a game's thread when a step ran past its time limit."""
