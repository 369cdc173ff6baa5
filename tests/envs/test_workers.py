"""``WorkerPool.release``: a worker frees its slot as its last step, and is counted done once."""

from __future__ import annotations

import asyncio
import logging

from atroposlib.envs.base import BaseEnv, BaseEnvConfig
from atroposlib.envs.workers import WorkerPool

from .test_base_hooks import SERVER


class _Counter:
    """An ``on_done`` callback that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


async def _settle(task: asyncio.Task) -> None:
    """Wait for ``task`` and for the done callbacks it scheduled (the pool's among them)."""
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0)


async def test_a_released_worker_leaves_the_pool_before_it_returns_and_is_done_once():
    on_done = _Counter()
    pool = WorkerPool(on_done=on_done)
    released, finish = asyncio.Event(), asyncio.Event()

    async def work(key: str) -> None:
        pool.release(asyncio.current_task())
        released.set()
        await finish.wait()

    key = pool.spawn("item", work)
    task = pool.running[key]["worker"]
    await released.wait()
    assert not task.done()
    assert len(pool) == 0 and task not in pool.tasks
    assert on_done.calls == 1

    finish.set()
    await _settle(task)
    assert on_done.calls == 1  # finishing does not count the worker done a second time
    assert len(pool) == 0


def _pool_with_waiting_worker() -> tuple[WorkerPool, _Counter, asyncio.Task, asyncio.Event]:
    """A pool counting ``on_done`` calls, with one worker that returns once the event is set."""
    on_done = _Counter()
    pool = WorkerPool(on_done=on_done)
    finish = asyncio.Event()

    async def work(key: str) -> None:
        await finish.wait()

    key = pool.spawn("item", work)
    return pool, on_done, pool.running[key]["worker"], finish


async def test_a_worker_that_did_not_release_is_done_once_when_it_finishes():
    pool, on_done, task, finish = _pool_with_waiting_worker()
    await asyncio.sleep(0)
    assert len(pool) == 1 and on_done.calls == 0
    finish.set()
    await _settle(task)
    assert len(pool) == 0 and on_done.calls == 1


async def test_releasing_none_an_unknown_task_or_twice_changes_nothing():
    pool, on_done, worker, finish = _pool_with_waiting_worker()
    stranger = asyncio.create_task(asyncio.sleep(0))
    pool.release(None)
    pool.release(stranger)
    assert len(pool) == 1 and on_done.calls == 0

    pool.release(worker)
    pool.release(worker)
    assert len(pool) == 0 and on_done.calls == 1
    finish.set()
    await _settle(worker)
    await stranger
    assert on_done.calls == 1


async def test_a_crashing_worker_that_released_is_still_logged_as_crashed(caplog):
    on_done = _Counter()
    pool = WorkerPool(on_done=on_done)

    async def work(key: str) -> None:
        pool.release(asyncio.current_task())
        raise RuntimeError("broke after releasing")

    key = pool.spawn("item", work)
    task = pool.running[key]["worker"]
    with caplog.at_level(logging.ERROR, logger="atroposlib.envs.workers"):
        await _settle(task)
    crashed = [r for r in caplog.records if "rollout worker crashed" in r.getMessage()]
    assert len(crashed) == 1 and "broke after releasing" in crashed[0].getMessage()
    assert on_done.calls == 1 and len(pool) == 0


class _NothingEnv(BaseEnv):
    """Every item collects nothing (so nothing is sent); ``cleanup`` may be made to fail."""

    name = "nothing_env"
    cleanup_error: Exception | None = None

    async def setup(self):
        pass

    async def get_next_item(self):
        return "item"

    async def collect_trajectories(self, item):
        return None, []

    async def evaluate(self, *args, **kwargs):
        pass

    async def cleanup(self):
        if self.cleanup_error is not None:
            raise self.cleanup_error


def _env_recording_done() -> tuple[_NothingEnv, list[tuple[int, bool]], list[asyncio.Task]]:
    """An env whose pool records, at each ``on_done``, the pool's size and whether the
    worker tasks (the list returned, filled by the test) had already returned."""
    env = _NothingEnv(BaseEnvConfig(use_wandb=False, group_size=2), [SERVER])
    pool = env.runner.pool
    seen: list[tuple[int, bool]] = []
    workers: list[asyncio.Task] = []
    pool._on_done = lambda: seen.append((len(pool), all(t.done() for t in workers)))
    return env, seen, workers


async def test_run_item_releases_the_workers_slot_as_its_last_step():
    env, seen, workers = _env_recording_done()
    key = env.runner.pool.spawn("item", env.handle_env)
    workers.append(env.runner.pool.running[key]["worker"])
    await _settle(workers[0])
    # Once, from the worker itself while it was still running (not from its done callback).
    assert seen == [(0, False)]
    assert key not in env.runner.pool.running


async def test_run_item_whose_cleanup_fails_is_done_once_and_logged_as_crashed(caplog):
    env, seen, workers = _env_recording_done()
    env.cleanup_error = RuntimeError("cleanup broke")
    key = env.runner.pool.spawn("item", env.handle_env)
    workers.append(env.runner.pool.running[key]["worker"])
    with caplog.at_level(logging.ERROR, logger="atroposlib.envs.workers"):
        await _settle(workers[0])
    assert seen == [(0, True)]  # not released: counted done by the done callback
    assert any("cleanup broke" in r.getMessage() for r in caplog.records)
