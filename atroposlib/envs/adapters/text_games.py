"""A multi-turn text game, and the loop that plays one episode of it.

A :class:`TextGame` is ``reset(seed) -> Turn`` (who moves and what they see) and
``step(text) -> StepResult`` (the next turn, or the final rewards when done). Players
are async functions ``(messages, max_tokens) -> reply``: the policy through
``ManagedServer``, the same policy untracked (self-play), or a scripted opponent.
:func:`play_episode` drives one game to its end, or stops it with a logged reason:
``max_turns``, ``token_budget``, ``step_timeout`` (a ``step`` that hangs is
interrupted after ``step_timeout_s``), ``step_error``, or the reason of an
:class:`EpisodeEnded` a player raised (an opponent whose server failed).

A :class:`TextGame` given to :func:`play_episode` is moved into a worker process
(``game_worker.in_worker``: pickled, then rebuilt there), and a step past its time limit
kills that worker, which the pool replaces: a step blocked in C (a sleep, a regex that
backtracks while holding the GIL) stops the event loop and every other episode no more
than one that loops in Python, and leaves no thread behind. Only a game that cannot be
pickled still runs in a thread (with a warning), which stops a step that loops in Python
but not one blocked in C. An :class:`AsyncTextGame` is awaited, and cancelled at its time
limit: one whose game runs in a worker process (``game_worker.ProcessGame``) is killed there.

Each player keeps its own conversation: the system prompt, then for every turn its
observation as a user message and its reply as an assistant message, so the policy's
turns extend one token sequence and only they are trained.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import threading
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Dict, List

from atroposlib.envs.adapters.game_worker import GameWorkerPool, in_worker
from atroposlib.envs.adapters.text_game_types import (
    AsyncTextGame,
    EpisodeEnded,
    GameStepTimeout,
    StepResult,
    TextGame,
    Turn,
)
from atroposlib.utils.aio import within

logger = logging.getLogger(__name__)

__all__ = [
    "Episode",
    "AsyncTextGame",
    "EpisodeEnded",
    "GameStepTimeout",
    "Player",
    "StepResult",
    "TextGame",
    "Turn",
    "play_episode",
    "run_with_timeout",
]

Messages = List[Dict[str, str]]
Player = Callable[[Messages, int], Awaitable[str]]


def run_with_timeout(fn: Callable[[], Any], timeout: float) -> Any:
    """``fn()`` in a daemon thread, at most ``timeout`` seconds.

    Past the limit, :class:`GameStepTimeout` is raised in the thread (so a game that
    loops in Python stops instead of burning a core) and here.
    """
    box: Dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # handed to the caller below
            box["error"] = err

    thread = threading.Thread(target=target, daemon=True, name="text-game-step")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        ident = thread.ident
        if ident is not None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(ident), ctypes.py_object(GameStepTimeout)
            )
        thread.join(1.0)
        raise GameStepTimeout(f"a game step ran past {timeout:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


async def _game_call(game: TextGame | AsyncTextGame, name: str, timeout: float, *args: Any) -> Any:
    """``game.name(*args)`` within ``timeout`` seconds (:class:`GameStepTimeout` past it)."""
    method = getattr(game, name)
    if isinstance(game, AsyncTextGame):
        try:
            return await within(method(*args), timeout)
        except asyncio.TimeoutError as err:
            raise GameStepTimeout(f"a game step ran past {timeout:g} s") from err
    return await asyncio.to_thread(run_with_timeout, lambda: method(*args), timeout)


@dataclass
class Episode:
    """One played game: rewards per player, why it ended, each player's conversation."""

    seed: int
    rewards: Dict[int, float]
    end_reason: str
    turns: int
    conversations: Dict[int, Messages]

    def reward(self, player: int) -> float:
        """``player``'s final reward (0.0 when the game gave none)."""
        return float(self.rewards.get(player, 0.0))


async def play_episode(
    game: TextGame | AsyncTextGame,
    players: Dict[int, Player],
    seed: int,
    *,
    system_prompt: str | None = None,
    max_turns: int = 50,
    max_tokens_per_turn: int = 256,
    step_timeout_s: float = 10.0,
    budget_left: Callable[[int], int] | None = None,
    workers: GameWorkerPool | None = None,
) -> Episode:
    """Play ``game`` from ``seed`` with ``players[player_id]`` making the moves.

    ``budget_left(player)`` (tokens left in that player's sequence) ends the episode
    before a reply could overflow it. The game's own calls get ``step_timeout_s`` each.
    A :class:`TextGame` plays in a worker process of ``workers`` (by default the
    process-wide ``game_worker.shared_pool()``), built
    from a pickled copy of ``game``: ``game`` itself is not stepped.
    """
    conversations: Dict[int, Messages] = {}

    def convo(player: int) -> Messages:
        if player not in conversations:
            conversations[player] = (
                [{"role": "system", "content": system_prompt}] if system_prompt else []
            )
        return conversations[player]

    turns, rewards, reason = 0, {}, "done"
    try:
        if isinstance(game, TextGame):
            game = await in_worker(game, workers)
        turn: Turn | None = await _game_call(game, "reset", step_timeout_s, seed)
        while turn is not None:
            if turns >= max_turns:
                reason = "max_turns"
                break
            if budget_left is not None and budget_left(turn.player) < max_tokens_per_turn:
                reason = "token_budget"
                break
            messages = convo(turn.player)
            messages.append({"role": "user", "content": turn.observation})
            reply = await players[turn.player](messages, max_tokens_per_turn)
            messages.append({"role": "assistant", "content": reply})
            turns += 1
            result: StepResult = await _game_call(game, "step", step_timeout_s, reply)
            if result.done:
                rewards = dict(result.rewards)
                break
            turn = result.turn
    except EpisodeEnded as err:
        reason = err.reason
        logger.warning("text game (seed %d) ended after %d turns: %s", seed, turns, err)
    except GameStepTimeout as err:
        reason = "step_timeout"
        logger.warning("text game (seed %d) ended after %d turns: %s", seed, turns, err)
    except Exception as err:  # a game bug ends this episode, not the worker
        reason = "step_error"
        logger.warning(
            "text game (seed %d) ended after %d turns: %s: %s",
            seed,
            turns,
            type(err).__name__,
            err,
        )
    finally:
        try:
            await _game_call(game, "close", step_timeout_s)
        except Exception as err:  # closing is best effort; the episode is already over
            logger.info("closing a text game failed: %s", err)
    for messages in conversations.values():
        if messages and messages[-1]["role"] == "user":
            messages.pop()  # an observation never answered is not part of the trajectory
    return Episode(seed, rewards, reason, turns, conversations)
