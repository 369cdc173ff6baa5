"""Cost of a text-game step in a worker process against one in a thread of this process.

Plays the same scripted episodes (TextArena games, both seats a scripted player) through
``play_episode`` twice, alternating round by round: with the game in this process
(``TextArenaGame`` kept out of a worker, each call in a thread with its time limit, as
before worker processes: ``play_episode`` now moves any game it can pickle into a worker)
and with the game in a warm worker process (``ProcessGame``: a pickle each way over a
pipe). Prints wall and CPU microseconds per step for each (CPU: this process's threads
plus the live workers'), the median and range over the rounds. The worker's start is
paid once per worker and is not counted.

Usage: python benchmarks/text_game_steps.py [--rounds 5] [--episodes 40] [--game Nim-v0]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import time
from typing import Callable, List, Tuple

import psutil

from atroposlib.envs.adapters.game_worker import GameWorkerPool, ProcessGame
from atroposlib.envs.adapters.text_games import play_episode
from atroposlib.envs.adapters.textarena import scripted_player
from atroposlib.envs.adapters.textarena_game import TextArenaGame, textarena_factory


class _InProcess(TextArenaGame):
    """A TextArena game that refuses to pickle, so ``play_episode`` steps it in a thread."""

    def __reduce__(self) -> tuple:
        raise TypeError("kept in this process for the comparison")


def _cpu(pool: GameWorkerPool) -> float:
    """CPU seconds of this process (all threads) and of the pool's live workers."""
    total = time.process_time()
    for pid in pool.pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


async def _episodes(
    make: Callable[[], object], pool: GameWorkerPool, n: int
) -> Tuple[int, float, float]:
    steps = 0
    wall, cpu = time.perf_counter(), _cpu(pool)
    for seed in range(n):
        game = make()
        if isinstance(game, ProcessGame):
            await game.start()
        episode = await play_episode(
            game, {p: scripted_player(seed * 10 + p) for p in range(2)}, seed, max_turns=400
        )
        steps += episode.turns + 1  # the moves and the reset
    return steps, time.perf_counter() - wall, _cpu(pool) - cpu


async def main(rounds: int, episodes: int, game_id: str) -> None:
    pool = GameWorkerPool()
    factory = textarena_factory(game_id, 2)
    await (await ProcessGame(pool, factory, 2).start()).close()  # a warm worker
    thread: List[Tuple[float, float]] = []
    worker: List[Tuple[float, float]] = []
    for _ in range(rounds):
        for out, make in (
            (thread, lambda: _InProcess(game_id, 2)),
            (worker, lambda: ProcessGame(pool, factory, 2)),
        ):
            steps, wall, cpu = await _episodes(make, pool, episodes)
            out.append((wall / steps * 1e6, cpu / steps * 1e6))
    await pool.close()
    print(f"{game_id}: {episodes} episodes x {rounds} rounds, load {os.getloadavg()[0]:.2f}")
    for name, rows in (("thread (in process)", thread), ("worker process", worker)):
        walls, cpus = [r[0] for r in rows], [r[1] for r in rows]
        print(
            f"  {name:20s} wall {statistics.median(walls):7.0f} us/step "
            f"({min(walls):.0f}-{max(walls):.0f}), CPU {statistics.median(cpus):7.0f} us/step "
            f"({min(cpus):.0f}-{max(cpus):.0f})"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--episodes", type=int, default=40)
    parser.add_argument("--game", default="Nim-v0")
    args = parser.parse_args()
    # The thread arm's "cannot run in a worker process" warning, once per episode, is expected.
    logging.getLogger("atroposlib.envs.adapters.game_worker").setLevel(logging.ERROR)
    asyncio.run(main(args.rounds, args.episodes, args.game))
