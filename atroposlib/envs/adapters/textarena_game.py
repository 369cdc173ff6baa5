"""One TextArena game behind the :class:`TextGame` interface, and the factory that builds
it in a game worker process.

TextArena games draw from the process-global ``random``; each game keeps its own
``random`` state, swapped in (under a lock) around every call into the game, so games
sharing a process do not disturb each other and an episode replays from its seed.
``TextArenaEnv`` runs each game in a worker process of its own
(:mod:`atroposlib.envs.adapters.game_worker`), where the lock is never contended and a
step that hangs is killed with its process. This module imports no more than TextArena,
so a worker starts quickly.
"""

from __future__ import annotations

import functools
import logging
import pickle
import random
import threading
from typing import Any, Callable, Dict

from atroposlib.envs.adapters.text_games import StepResult, TextGame, Turn

logger = logging.getLogger(__name__)

__all__ = ["TextArenaGame", "textarena_factory"]

_RANDOM_LOCK = threading.Lock()


class TextArenaGame(TextGame):
    """One TextArena game id behind the :class:`TextGame` interface."""

    def __init__(self, game_id: str, num_players: int):
        import textarena

        self.game_id = game_id
        self.num_players = num_players
        self.env = textarena.make(game_id)
        self._random_state: Any = None

    def __reduce__(self) -> tuple:
        # TextArena's wrapped envs do not survive a pickle (their attribute delegation
        # recurses): a game is sent to a worker process as its id and rebuilt there, fresh.
        # It is sent before its reset (play_episode), which sets every bit of its state.
        return (type(self), (self.game_id, self.num_players))

    def _with_own_random(self, fn: Callable[[], Any]) -> Any:
        with _RANDOM_LOCK:
            saved = random.getstate()
            random.setstate(self._random_state)
            try:
                return fn()
            finally:
                self._random_state = random.getstate()
                random.setstate(saved)

    def reset(self, seed: int) -> Turn:
        self._random_state = random.Random(seed).getstate()
        self._with_own_random(lambda: self.env.reset(num_players=self.num_players, seed=seed))
        return self._turn()

    def _turn(self) -> Turn:
        player, observation = self._with_own_random(self.env.get_observation)
        return Turn(int(player), observation if isinstance(observation, str) else str(observation))

    def step(self, text: str) -> StepResult:
        done, _info = self._with_own_random(lambda: self.env.step(text))
        if not done:
            return StepResult(self._turn(), False)
        closed = self._with_own_random(self.env.close)
        rewards = closed[0] if isinstance(closed, tuple) else closed
        return StepResult(None, True, _numeric_rewards(rewards, self.game_id))

    def close(self) -> None:
        """Nothing to release: ``step`` already closed a finished game."""


def _numeric_rewards(rewards: Any, game_id: str) -> Dict[int, float]:
    out: Dict[int, float] = {}
    for player, value in (rewards or {}).items():
        try:
            out[int(player)] = float(value)
        except (TypeError, ValueError):
            logger.info("%s: non-numeric reward %r for player %s; 0", game_id, value, player)
            out[int(player)] = 0.0
    return out


def _registered_game(game_id: str, num_players: int, spec: Any) -> TextArenaGame:
    """In a worker: register ``spec`` (the parent's registration of ``game_id``, so games
    an environment file registers are found) and build the game."""
    from textarena.envs.registration import ENV_REGISTRY

    ENV_REGISTRY[game_id] = spec
    return TextArenaGame(game_id, num_players)


def textarena_factory(game_id: str, num_players: int) -> Callable[[], TextArenaGame]:
    """A picklable factory of ``game_id``'s game as this process has it registered
    (``ValueError`` naming it when it is not, or when its registration cannot be sent to a
    worker process: register it with an importable entry point)."""
    from textarena.envs.registration import ENV_REGISTRY

    spec = ENV_REGISTRY.get(game_id)
    if spec is None:
        raise ValueError(f"TextArena game {game_id!r} is not registered (env.game_ids)")
    factory = functools.partial(_registered_game, game_id, num_players, spec)
    try:
        pickle.dumps(factory)
    except Exception as err:
        raise ValueError(
            f"TextArena game {game_id!r}: its registration cannot be sent to a game worker "
            f"process ({type(err).__name__}: {err}); register it with an importable entry "
            "point (a 'module:Class' string or a module-level class)"
        ) from err
    return factory
