"""TextArena games that hang in C on their third move, registered with TextArena on import.

``SleepInC-v0`` sleeps (``time.sleep`` releases the GIL but no thread can interrupt it);
``RegexBacktrack-v0`` runs a regular expression that backtracks for about ten seconds
(more on a loaded machine) while holding the GIL: far past a 2 s limit, yet bounded, so
a run where the limit fails ends too. Both are Tic Tac Toe otherwise, with its wrappers. Module-level classes, so the
registration reaches game worker processes.
"""

from __future__ import annotations

import re
import time

from textarena.envs.registration import ENV_REGISTRY, register
from textarena.envs.TicTacToe.env import TicTacToeEnv

from atroposlib.envs.adapters.text_games import StepResult, TextGame, Turn

HANG_ON_MOVE = 3
"""The move whose step hangs."""

HANG_S = 30.0
"""How long ``SleepInC-v0``'s step sleeps."""


class _CountingTicTacToe(TicTacToeEnv):
    def reset(self, num_players: int, seed: int | None = None):
        self.moves = 0
        return super().reset(num_players, seed)

    def step(self, action: str):
        self.moves += 1
        if self.moves == HANG_ON_MOVE:
            self.hang()
        return super().step(action)

    def hang(self) -> None:
        raise NotImplementedError


class SleepInCTicTacToe(_CountingTicTacToe):
    """Tic Tac Toe whose third step sleeps in C."""

    def hang(self) -> None:
        time.sleep(HANG_S)


class BacktrackingTicTacToe(_CountingTicTacToe):
    """Tic Tac Toe whose third step backtracks in ``re`` (2**27 paths, holding the GIL)."""

    def hang(self) -> None:
        re.match(r"(a+)+$", "a" * 27 + "b")


GAMES = {"SleepInC-v0": SleepInCTicTacToe, "RegexBacktrack-v0": BacktrackingTicTacToe}

for _game_id, _cls in GAMES.items():
    if _game_id not in ENV_REGISTRY:
        register(
            _game_id,
            entry_point=_cls,
            default_wrappers=ENV_REGISTRY["TicTacToe-v0"].default_wrappers,
        )


class SleepingGame(TextGame):
    """A one-player game whose every step sleeps in C."""

    def reset(self, seed: int) -> Turn:
        return Turn(0, "go")

    def step(self, text: str) -> StepResult:
        time.sleep(HANG_S)
        return StepResult(Turn(0, "again"), False)


def exploding_game() -> TextGame:
    """A game factory that raises (a game whose constructor fails)."""
    raise ZeroDivisionError("the game's constructor failed")


class BacktrackingGame(TextGame):
    """A one-player game whose second step backtracks in ``re`` holding the GIL (seconds)."""

    def reset(self, seed: int) -> Turn:
        self.moves = 0
        return Turn(0, "go")

    def step(self, text: str) -> StepResult:
        self.moves += 1
        if self.moves == 2:
            re.match(r"(a+)+$", "a" * 27 + "b")
        return StepResult(Turn(0, "again"), False)


class CountingGame(TextGame):
    """A one-player game that ends after three moves, rewarding 1."""

    def reset(self, seed: int) -> Turn:
        self.moves = 0
        return Turn(0, f"seed {seed}")

    def step(self, text: str) -> StepResult:
        self.moves += 1
        if self.moves == 3:
            return StepResult(None, True, {0: 1.0})
        return StepResult(Turn(0, f"move {self.moves}"), False)
