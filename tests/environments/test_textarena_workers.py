"""``TextArenaEnv`` runs each game in a worker process: a game that hangs in C (a sleep, a
regex that backtracks holding the GIL) ends its own episode at the step limit, while the
other episodes play on with their turns and the event loop never stalls; killed workers
are replaced, and closing leaves no process or thread behind."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Dict, List, Tuple

import psutil
import pytest

pytest.importorskip("textarena")

from atroposlib.envs.adapters.game_worker import GameWorkerPool, ProcessGame  # noqa: E402
from atroposlib.envs.adapters.text_games import play_episode  # noqa: E402
from atroposlib.envs.adapters.textarena import (  # noqa: E402
    TextArenaEnv,
    TextArenaEnvConfig,
    scripted_player,
)
from atroposlib.envs.adapters.textarena_game import textarena_factory  # noqa: E402
from atroposlib.envs.server_handling.server_baseline import APIServerConfig  # noqa: E402
from tests.environments import text_game_doubles  # noqa: E402 - registers the hanging games

LIMIT_S = 2.0


def _env(**config: Any) -> TextArenaEnv:
    server = APIServerConfig(
        base_url="http://127.0.0.1:9/v1", model_name="unused", health_check=False
    )
    return TextArenaEnv(
        TextArenaEnvConfig(step_timeout_s=LIMIT_S, use_wandb=False, **config),
        [server],
        testing=True,
    )


async def _timed(env: TextArenaEnv, game_id: str, seed: int) -> Tuple[str, int, float, Any]:
    players = {p: scripted_player(seed * 10 + p) for p in range(2)}
    start = time.perf_counter()
    episode = await env.run_episode({"game_id": game_id, "seed": seed}, players)
    seconds = time.perf_counter() - start
    return episode.end_reason, episode.turns, seconds, episode.conversations


def test_games_hung_in_c_end_at_the_limit_and_nothing_else_waits():
    threads_before = {t.ident for t in threading.enumerate()}
    me = psutil.Process()
    children_before = {p.pid for p in me.children(recursive=True)}

    async def scenario() -> Dict[str, Any]:
        env = _env()
        # Warm workers first: a new one's start (interpreter, TextArena import) is not a
        # step. These episodes are also what the same seeds must give beside hung games.
        warm = await asyncio.gather(*(_timed(env, "TicTacToe-v0", s) for s in (13, 14, 15, 16)))
        assert all(r[0] == "done" for r in warm), warm
        workers = set(env.game_workers().pids)
        gaps: List[float] = []

        async def heartbeat() -> None:
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.02)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        beat = asyncio.create_task(heartbeat())
        played = await asyncio.gather(
            _timed(env, "SleepInC-v0", 11),
            _timed(env, "RegexBacktrack-v0", 12),
            _timed(env, "TicTacToe-v0", 13),
            _timed(env, "TicTacToe-v0", 14),
        )
        beat.cancel()
        # The two killed workers are replaced; the two others are reused.
        after = await asyncio.gather(*(_timed(env, "TicTacToe-v0", s) for s in (15, 16, 17, 18)))
        reused = workers & set(env.game_workers().pids)
        await env.close_game_workers()
        return {
            "warm": warm,
            "played": played,
            "after": after,
            "max_gap": max(gaps),
            "reused": reused,
        }

    out = asyncio.run(scenario())
    sleep, regex, *others = out["played"]
    for reason, turns, seconds, _ in (sleep, regex):
        assert reason == "step_timeout" and turns == text_game_doubles.HANG_ON_MOVE
        assert LIMIT_S <= seconds < LIMIT_S + 2.5, seconds
    # The episodes beside them played every turn, exactly as they did alone.
    assert [r[:2] for r in others] == [r[:2] for r in out["warm"][:2]]
    assert [r[3] for r in others] == [r[3] for r in out["warm"][:2]]
    assert [r[3] for r in out["after"][:2]] == [r[3] for r in out["warm"][2:]]
    for reason, turns, _, _ in out["warm"] + out["after"]:
        assert reason == "done" and turns >= 1
    assert out["max_gap"] < 1.0, out["max_gap"]  # a frozen loop: as long as the hang
    assert len(out["reused"]) == 2, out["reused"]
    left = {p.pid for p in me.children(recursive=True)} - children_before
    assert not left, left
    threads = [t for t in threading.enumerate() if t.ident not in threads_before]
    for _ in range(100):  # a reaper thread may be returning just now
        if not threads:
            break
        time.sleep(0.01)
        threads = [t for t in threads if t.is_alive()]
    assert not threads, threads


def test_episodes_in_workers_replay_from_their_seed():
    async def both() -> list:
        env = _env()

        def one(seed: int) -> Any:
            players = {p: scripted_player(p) for p in range(2)}
            return env.run_episode({"game_id": "PigDice-v0", "seed": seed}, players)

        try:
            return await asyncio.gather(one(5), one(6)) + [await one(5)]
        finally:
            await env.close_game_workers()

    a, _, b = asyncio.run(both())
    assert a.end_reason == "done"
    assert a.conversations == b.conversations and a.rewards == b.rewards


def test_a_game_error_and_an_unknown_game_are_named():
    async def run() -> str:
        env = _env()
        try:
            with pytest.raises(ValueError, match="'NoSuchGame-v0' is not registered"):
                await _timed(env, "NoSuchGame-v0", 0)
            pool = env.game_workers()
            game = ProcessGame(pool, text_game_doubles.exploding_game)
            with pytest.raises(ZeroDivisionError, match="constructor failed"):
                await game.start()
            # The worker that raised is kept: the next game reuses it.
            assert len(pool.pids) == 1
            ok = await play_episode(
                await ProcessGame(pool, textarena_factory("TicTacToe-v0", 2)).start(),
                {p: scripted_player(p) for p in range(2)},
                0,
                step_timeout_s=LIMIT_S,
            )
            return ok.end_reason
        finally:
            await env.close_game_workers()

    assert asyncio.run(run()) == "done"


def test_an_unpicklable_registration_is_refused_with_the_game_id():
    from textarena.envs.registration import ENV_REGISTRY, register

    register("Unpicklable-v0", entry_point=lambda: None)
    try:
        with pytest.raises(ValueError, match="'Unpicklable-v0'.*importable entry point"):
            _env().game_factory({"game_id": "Unpicklable-v0", "seed": 0})
    finally:
        del ENV_REGISTRY["Unpicklable-v0"]


def test_a_cancelled_episode_kills_its_worker():
    async def run() -> bool:
        pool = GameWorkerPool()
        game = await ProcessGame(pool, text_game_doubles.SleepingGame).start()
        await game.reset(0)
        step = asyncio.create_task(game.step("[0]"))
        await asyncio.sleep(0.2)
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step
        assert game.worker is not None and game.worker.dead
        pid = game.worker.pid
        await game.close()
        await pool.close()
        return psutil.pid_exists(pid)

    assert not asyncio.run(run())


_ORPHAN_SCRIPT = """
import asyncio, sys
from atroposlib.envs.adapters.game_worker import GameWorkerPool, ProcessGame
from tests.environments.text_game_doubles import SleepingGame

async def main():
    game = await ProcessGame(GameWorkerPool(), SleepingGame).start()
    await game.reset(0)
    print(game.worker.pid, flush=True)
    await game.step("sleeps in C")

asyncio.run(main())
"""


def test_a_worker_hung_in_c_dies_with_its_parent():
    import signal
    import subprocess
    import sys

    from tests.conftest import ROOT

    parent = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN_SCRIPT], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        worker = int(parent.stdout.readline())
        time.sleep(0.2)  # the step is sleeping now
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        for _ in range(100):
            try:
                if psutil.Process(worker).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"game worker {worker} outlived its parent")
    finally:
        parent.kill()
        parent.wait(10)
