"""EnvRunner: the loop state lives in the runner, the env keeps its hooks and original names."""

from __future__ import annotations

import ast
import asyncio
import json
from pathlib import Path

import pytest

from atroposlib.envs.base import BaseEnv, BaseEnvConfig
from atroposlib.envs.offline import ProcessFailedError, html_report
from atroposlib.envs.runner import EnvRunner
from atroposlib.envs.scheduling import EnvStatus
from atroposlib.testing.aio import swallow_one_cancellation

from .test_base_hooks import SERVER, group, make_env

ENVS = Path(__file__).resolve().parents[2] / "atroposlib" / "envs"

# Instance attributes environment files written for the original read or set.
ORIGINAL_ATTRIBUTES = (
    "config",
    "server",
    "testing",
    "tokenizer",
    "curr_step",
    "max_token_len",
    "status_dict",
    "derived_batch_size",
    "env_id",
    "wandb_prepend",
    "checkpoint_dir",
    "checkpoint_interval",
    "max_num_workers",
    "backlog",
    "workers",
    "running_items",
    "eval_workers",
    "eval_runner",
    "items_sent_this_step",
    "jsonl_writer",
    "process_mode",
    "n_groups_to_process",
    "group_size_to_process",
    "rollouts_for_wandb",
    "completion_lengths",
    "task_duration",
    "succeeded_task_duration",
    "failed_task_duration",
    "mainloop_timings",
    "workers_added_list",
)


class GroupEnv(BaseEnv):
    """Makes one fixed group per item; counts items."""

    name = "group_env"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.items = 0

    async def setup(self):
        pass

    async def get_next_item(self):
        self.items += 1
        return self.items

    async def collect_trajectories(self, item):
        return group(n=self.config.group_size), []

    async def evaluate(self, *args, **kwargs):
        pass


class OwnPoolEnv(GroupEnv):
    """Uses ``self.pool`` for its own process pool, as original environment files do."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pool = "a multiprocessing.Pool of the environment's own"


def test_every_original_attribute_is_on_a_fresh_env():
    env = make_env(group_size=2)
    missing = [name for name in ORIGINAL_ATTRIBUTES if not hasattr(env, name)]
    assert not missing


def test_the_env_names_show_the_runners_state():
    env = make_env(group_size=2)
    assert isinstance(env.runner, EnvRunner) and env.runner.env is env
    assert env.workers is env.runner.pool.tasks
    assert env.running_items is env.runner.pool.running
    env.derived_batch_size = 12
    assert env.runner.derived_batch_size == 12
    sentinel = object()
    env.eval_runner = sentinel  # type: ignore[assignment]
    assert env.runner.eval_task is sentinel and env.eval_runner is sentinel


async def test_an_env_attribute_named_pool_does_not_break_the_workers():
    env = OwnPoolEnv(BaseEnvConfig(use_wandb=False, group_size=2, batch_size=8), [SERVER])
    env.max_num_workers = 2
    env.derived_batch_size = 8
    env.runner.status = EnvStatus()
    await env.add_train_workers()
    assert len(env.running_items) == 2 and env.items == 2
    await env.runner.pool.wait_all(5)
    assert env.pool == "a multiprocessing.Pool of the environment's own"


async def test_process_hands_the_written_jsonl_to_the_report_writer(tmp_path):
    out = tmp_path / "groups.jsonl"
    config = BaseEnvConfig(
        use_wandb=False,
        group_size=2,
        total_steps=3,
        data_path_to_save_groups=str(out),
        ensure_scores_are_not_same=False,
    )
    env = GroupEnv(config, [SERVER], testing=True)
    reports: list[Path] = []

    async def report(path: Path) -> None:
        reports.append(path)

    env.runner.write_report = report
    await env.process_manager()
    assert reports == [out]
    assert len(out.read_text().splitlines()) == 3 and env.curr_step == 3


async def test_html_report_renders_the_jsonl_beside_it(tmp_path):
    src = tmp_path / "run.jsonl"
    row = {**group(n=2), "messages": [[{"role": "user", "content": "hello report"}]] * 2}
    src.write_text(json.dumps(row) + "\n")
    await html_report(src)
    assert "hello report" in src.with_suffix(".html").read_text()


async def test_html_report_failure_names_the_file(tmp_path):
    missing = tmp_path / "absent.jsonl"
    with pytest.raises(ProcessFailedError, match="absent.jsonl"):
        await html_report(missing)


async def test_request_stop_before_serving_cancels_the_setup():
    env = make_env(group_size=2)
    started = asyncio.Event()

    async def slow_setup():
        started.set()
        await asyncio.sleep(3600)

    env.setup = slow_setup  # type: ignore[method-assign]
    task = asyncio.create_task(env.env_manager())
    await started.wait()
    env.runner.request_stop()
    await asyncio.wait_for(task, 30)  # returns instead of raising CancelledError
    assert task.done() and not task.cancelled()


def _private_env_fields(path: Path) -> list[str]:
    """``env._<name>`` accesses in ``path`` (another object's private fields)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        f"{path.name}:{node.lineno}: env.{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "env"
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
    ]


def test_loop_modules_use_no_private_field_of_the_env():
    found = [
        hit
        for name in ("runner", "serve", "offline", "cli")
        for hit in _private_env_fields(ENVS / f"{name}.py")
    ]
    assert not found, found


class FailingItemsEnv(GroupEnv):
    """``get_next_item`` raises on its first call; ``collect_trajectories`` on item 2."""

    async def get_next_item(self):
        self.items += 1
        if self.items == 1:
            raise ValueError("no item today")
        return self.items

    async def collect_trajectories(self, item):
        if item == 2:
            raise ValueError("broken scorer")
        return await super().collect_trajectories(item)


async def test_a_failing_get_next_item_is_counted_and_gives_the_failed_marker(caplog):
    env = FailingItemsEnv(BaseEnvConfig(use_wandb=False, group_size=2), [SERVER])
    runner = env.runner
    assert await runner.next_item() is runner.FAILED
    assert runner.failures.consecutive == 1
    assert "get_next_item failed" in caplog.text and "no item today" in caplog.text
    assert await runner.next_item() == 2


async def test_attempt_lets_cancellation_through():
    env = make_env(group_size=2)

    async def cancelled():
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await env.runner.attempt("x", cancelled, env.runner.FAILED, "x failed")
    assert env.runner.failures.consecutive == 0


async def test_process_skips_failed_items_and_counts_them(tmp_path):
    out = tmp_path / "groups.jsonl"
    config = BaseEnvConfig(
        use_wandb=False,
        group_size=2,
        total_steps=2,
        data_path_to_save_groups=str(out),
        ensure_scores_are_not_same=False,
        max_num_workers=1,
    )
    env = FailingItemsEnv(config, [SERVER], testing=True)

    async def no_report(path: Path) -> None:
        return None

    env.runner.write_report = no_report
    await env.process_manager()
    # Item 1 failed to be made, item 2 to be collected; items 3 and 4 became the groups.
    assert env.items == 4 and env.curr_step == 2
    assert len(out.read_text().splitlines()) == 2
    assert env.runner.failures.consecutive == 0  # a success after the failures resets it


async def test_collect_stamps_the_groups_with_what_their_requests_saw():
    from atroposlib.envs.server_handling.policy_version import note_version

    class VersionedEnv(GroupEnv):
        async def collect_trajectories(self, item):
            note_version(7)
            return [group(n=2), None], ["backlog item"]

    env = VersionedEnv(BaseEnvConfig(use_wandb=False, group_size=2), [SERVER])
    result, backlog = await env.runner.collect(1)
    assert backlog == ["backlog item"] and result[1] is None
    assert result[0]["policy_version"] == [7, 7]


async def test_serving_exempts_startup_objects_from_full_collections_until_it_ends(
    tmp_path, monkeypatch
):
    import gc

    monkeypatch.setenv("ATROPOS_OUTBOX_DIR", str(tmp_path / "outbox"))
    env = make_env(group_size=2)

    async def nothing() -> None:
        return None

    for hook in ("setup", "setup_wandb", "register_env", "get_server_info"):
        setattr(env, hook, nothing)
    frozen_while_serving: list[int] = []

    async def serve_loop() -> None:
        frozen_while_serving.append(gc.get_freeze_count())

    env.runner._serve_loop = serve_loop  # type: ignore[method-assign]
    # Whatever ran before in this process: finalize coroutines earlier tests abandoned (their
    # freeze blocks end when they are collected), then start from no freeze.
    gc.collect()
    gc.unfreeze()
    await asyncio.wait_for(env.runner.serve(), 60)
    assert frozen_while_serving[0] > 0
    assert gc.get_freeze_count() == 0


async def test_worker_keys_are_random_version_4_uuids():
    import uuid

    from atroposlib.envs.workers import WorkerPool

    pool = WorkerPool()

    async def run(key: str) -> None:
        return None

    keys = {pool.spawn(i, run) for i in range(200)}
    await pool.wait_all(timeout_s=10)
    assert len(keys) == 200
    for key in keys:
        parsed = uuid.UUID(key)
        assert str(parsed) == key and parsed.version == 4 and parsed.variant == uuid.RFC_4122


async def test_shutdown_ends_a_status_poll_that_swallowed_its_cancellation(tmp_path, monkeypatch):
    """A poll's library can swallow a cancellation that lands as its call finishes (as
    ``asyncio.wait_for`` did before Python 3.12); the status loop then went on polling and
    shutting down waited for it for ever."""
    from atroposlib.utils import aio

    monkeypatch.setattr(aio, "RECANCEL_S", 0.01)
    monkeypatch.setenv("ATROPOS_OUTBOX_DIR", str(tmp_path / "outbox"))
    env = make_env(group_size=2)
    polls: list[int] = []
    env.runner._status_task = asyncio.create_task(swallow_one_cancellation(polls))
    await asyncio.sleep(0.005)
    await asyncio.wait_for(env.runner._shutdown(), 30)  # hang guard only: the old one never ended
    assert env.runner._status_task.cancelled() and len(polls) > 1
