"""``play_episode`` runs a plain ``TextGame`` in a worker process: a step stuck in C (a
sleep, a regex backtracking with the GIL held) ends its episode at the step limit without
stalling the event loop, its worker is killed and replaced, and nothing is left behind:
no thread, and no process once the pool is closed. Idle workers serve later event loops."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Dict, List

import psutil
import pytest

pytest.importorskip("textarena")  # the doubles register TextArena games too

from atroposlib.envs.adapters.game_worker import (  # noqa: E402
    GameWorkerPool,
    ProcessGame,
    shared_pool,
)
from atroposlib.envs.adapters.text_games import (  # noqa: E402
    StepResult,
    TextGame,
    Turn,
    play_episode,
)
from tests.environments.text_game_doubles import (  # noqa: E402
    BacktrackingGame,
    CountingGame,
    SleepingGame,
)

LIMIT_S = 1.0


async def _move(messages: List[Dict[str, str]], max_tokens: int) -> str:
    return "[1]"


def _new_threads(before: set) -> list:
    threads = [t for t in threading.enumerate() if t.ident not in before]
    for _ in range(100):  # a thread may be returning just now
        if not threads:
            break
        time.sleep(0.01)
        threads = [t for t in threads if t.is_alive()]
    return threads


def test_games_stuck_in_c_stall_nothing_and_leave_nothing():
    threads_before = {t.ident for t in threading.enumerate()}
    me = psutil.Process()
    children_before = {p.pid for p in me.children(recursive=True)}

    async def scenario() -> Dict[str, Any]:
        pool = GameWorkerPool()
        # Three warm workers: a worker's start (an interpreter) is not a step.
        warm = await asyncio.gather(
            *(play_episode(CountingGame(), {0: _move}, s, workers=pool) for s in (1, 2, 3))
        )
        first = set(pool.pids)
        gaps: List[float] = []

        async def heartbeat() -> None:
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.02)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        beat = asyncio.create_task(heartbeat())
        start = time.perf_counter()
        played = await asyncio.gather(
            play_episode(SleepingGame(), {0: _move}, 0, step_timeout_s=LIMIT_S, workers=pool),
            play_episode(BacktrackingGame(), {0: _move}, 0, step_timeout_s=LIMIT_S, workers=pool),
            play_episode(CountingGame(), {0: _move}, 3, step_timeout_s=LIMIT_S, workers=pool),
        )
        took = time.perf_counter() - start
        beat.cancel()
        after = await asyncio.gather(
            *(play_episode(CountingGame(), {0: _move}, s, workers=pool) for s in (4, 5, 6))
        )
        replaced = set(pool.pids) - first
        await pool.close()
        return {
            "warm": warm,
            "played": played,
            "after": after,
            "took": took,
            "gaps": gaps,
            "replaced": replaced,
        }

    out = asyncio.run(scenario())
    sleeping, regex, beside = out["played"]
    assert (sleeping.end_reason, sleeping.turns) == ("step_timeout", 1)
    assert (regex.end_reason, regex.turns) == ("step_timeout", 2)
    assert out["took"] < LIMIT_S + 4.0, out["took"]  # the hangs last 10 s and 30 s
    assert beside.end_reason == "done" and beside.rewards == {0: 1.0}
    assert all(e.end_reason == "done" for e in [*out["warm"], *out["after"]])
    assert max(out["gaps"]) < 1.0, max(out["gaps"])  # a frozen loop: as long as the hang
    assert len(out["replaced"]) == 2, out["replaced"]  # the two killed workers' successors
    assert not {p.pid for p in me.children(recursive=True)} - children_before
    assert not _new_threads(threads_before)


def test_idle_workers_of_the_shared_pool_serve_later_event_loops():
    async def close() -> None:
        await shared_pool().close()

    asyncio.run(close())  # a fresh pool: earlier tests of this process may have used it
    threads_before = {t.ident for t in threading.enumerate()}

    async def one(seed: int) -> tuple:
        episode = await play_episode(CountingGame(), {0: _move}, seed)
        return episode.end_reason, episode.conversations[0][0]["content"], shared_pool().pids

    first = asyncio.run(one(7))
    second = asyncio.run(one(8))
    assert first[:2] == ("done", "seed 7") and second[:2] == ("done", "seed 8")
    assert first[2] == second[2] and len(first[2]) == 1  # the same worker, reused
    assert not _new_threads(threads_before)
    pid = first[2][0]
    asyncio.run(close())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


class _Unpicklable(TextGame):
    """Holds a lock: it cannot go to a worker, so it plays in a thread as before."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def reset(self, seed: int) -> Turn:
        self.moves = 0
        return Turn(0, "go")

    def step(self, text: str) -> StepResult:
        self.moves += 1
        return (
            StepResult(None, True, {0: 0.5}) if self.moves == 2 else StepResult(Turn(0, "x"), False)
        )


def test_a_game_that_cannot_be_pickled_plays_in_a_thread_with_a_warning(caplog):
    caplog.set_level(logging.WARNING)
    game = _Unpicklable()
    episode = asyncio.run(play_episode(game, {0: _move}, 0))
    assert episode.end_reason == "done" and episode.rewards == {0: 0.5}
    assert game.moves == 2  # stepped here, not in a worker
    assert "cannot run in a worker process" in caplog.text and "_Unpicklable" in caplog.text


def test_a_game_given_as_a_process_game_is_played_as_it_is():
    async def run() -> tuple:
        pool = GameWorkerPool()
        try:
            game = await ProcessGame(pool, CountingGame).start()
            episode = await play_episode(game, {0: _move}, 5, workers=pool)
            return episode.end_reason, len(pool.pids)
        finally:
            await pool.close()

    assert asyncio.run(run()) == ("done", 1)
