"""Serve-loop decisions in-process: registration, step hooks, worker filling, eval pausing."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from atroposlib.envs.api_client import RolloutAPIClient
from atroposlib.envs.base import BaseEnvConfig, EvalHandlingEnum
from atroposlib.envs.scheduling import EnvStatus

from .test_base_hooks import SERVER, ItemEnv


class StepEnv(ItemEnv):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.items = iter(range(1000))
        self.evals = 0
        self.saved = []
        self.logged = 0
        self.eval_gate = asyncio.Event()

    async def get_next_item(self):
        return next(self.items)

    async def collect_trajectories(self, item):
        await asyncio.sleep(3600)

    async def evaluate(self, *args, **kwargs):
        self.evals += 1
        await self.eval_gate.wait()

    def save_checkpoint(self, step, data=None):
        self.saved.append(step)

    async def wandb_log(self, wandb_metrics=None):
        self.logged += 1


def make(**config) -> StepEnv:
    config.setdefault("use_wandb", False)
    return StepEnv(BaseEnvConfig(**config), [SERVER])


def api(responses: dict) -> RolloutAPIClient:
    def handler(request: httpx.Request) -> httpx.Response:
        body = responses[request.url.path]
        return httpx.Response(200, json=body(request) if callable(body) else body)

    return RolloutAPIClient("http://api.test", transport=httpx.MockTransport(handler))


async def test_register_env_adopts_server_values_and_falls_back_to_class_name():
    sent = {}

    def register(request):
        sent.update(json.loads(request.content))
        return {
            "status": "success",
            "env_id": 3,
            "wandb_name": "item_env_1",
            "checkpoint_dir": "",
            "starting_step": 0,
            "checkpoint_interval": 5,
            "num_steps": 42,
        }

    env = make(total_steps=-1, group_size=2)
    env.runner.api = api(
        {"/register-env": register, "/info": {"batch_size": 16, "max_token_len": 256}}
    )
    await env.register_env()
    await env.get_server_info()
    await env.runner.api.aclose()
    assert sent["desired_name"] == "item_env" and sent["group_size"] == 2
    assert (env.env_id, env.wandb_prepend, env.checkpoint_interval) == (3, "item_env_1", 5)
    assert env.config.total_steps == 42
    assert (env.config.batch_size, env.max_token_len) == (16, 256)


async def test_group_larger_than_batch_is_an_error():
    env = make(group_size=32)
    env.runner.api = api({"/info": {"batch_size": 16, "max_token_len": 256}})
    with pytest.raises(ValueError, match="group_size"):
        await env.get_server_info()
    await env.runner.api.aclose()


async def test_step_change_runs_eval_checkpoint_and_logging_on_crossings():
    env = make(steps_per_eval=2, min_items_sent_before_logging=1)
    env.checkpoint_interval = 3
    env.eval_gate.set()
    env.runner.status = EnvStatus(current_step=1)
    await env.env_step_checks()
    assert (env.evals, env.saved, env.curr_step) == (0, [], 1)
    env.items_sent_this_step = 1
    env.runner.status = EnvStatus(current_step=4)  # crosses 2 and 4 (eval) and 3 (checkpoint)
    await env.env_step_checks()
    await asyncio.sleep(0)
    await env.eval_runner
    assert (env.evals, env.saved, env.curr_step, env.logged) == (1, [3], 4, 1)
    env.runner.status = EnvStatus(current_step=4)
    await env.env_step_checks()
    assert env.logged == 1  # no step change, no log


async def test_workers_fill_to_cap_backlog_first_fifo():
    env = make(max_num_workers=3, group_size=4, batch_size=16, max_batches_offpolicy=0)
    env.max_num_workers = 3
    env.runner.status = EnvStatus()
    env.derived_batch_size = 16
    env.backlog.extend(["b1", "b2"])
    await env.add_train_workers()
    items = sorted((v["start_time"], v["item"]) for v in env.running_items.values())
    assert [i for _, i in items][:2] == ["b1", "b2"] and len(env.running_items) == 3
    env.runner.pool.park_all()
    await env.runner.pool.wait_all(1)


async def test_stop_train_eval_parks_running_items_and_blocks_new_workers():
    env = make(
        max_num_workers=4,
        steps_per_eval=1,
        eval_handling=EvalHandlingEnum.STOP_TRAIN,
        batch_size=16,
        max_batches_offpolicy=0,
    )
    env.max_num_workers = 4
    env.derived_batch_size = 16
    env.runner.status = EnvStatus(current_step=0)
    await env.add_train_workers()
    assert len(env.running_items) == 4
    env.runner.status = EnvStatus(current_step=1)
    await env.env_step_checks()
    assert not env.running_items and len(env.runner.pool.requeue) == 4
    await env.add_train_workers()
    assert not env.running_items  # cap is 0 while the eval runs
    env.eval_gate.set()
    await env.eval_runner
    await env.add_train_workers()
    assert len(env.running_items) == 4  # re-queued items come back first
    env.runner.pool.park_all()
    await env.runner.pool.wait_all(1)


async def test_status_404_after_api_lost_its_registry_registers_again():
    calls = {"status": 0, "register": 0}

    def status(request):
        calls["status"] += 1
        if request.url.params["env_id"] == "0":
            return httpx.Response(404, json={"detail": "unknown env_id 0"})
        return httpx.Response(200, json={"current_step": 2, "queue_size": 1, "env_weight": 1.0})

    def register(request):
        calls["register"] += 1
        return httpx.Response(
            200,
            json={
                "status": "success",
                "env_id": 5,
                "wandb_name": "item_env_0",
                "checkpoint_dir": "",
                "starting_step": 2,
                "checkpoint_interval": -1,
                "num_steps": 10,
            },
        )

    def handler(request):
        return status(request) if request.url.path == "/status-env" else register(request)

    env = make(group_size=2, batch_size=8)
    env.env_id = 0
    env.runner.api = RolloutAPIClient("http://api.test", transport=httpx.MockTransport(handler))
    task = asyncio.create_task(env.runner.status_loop())
    for _ in range(100):
        if env.runner.status is not None:
            break
        await asyncio.sleep(0.02)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await env.runner.api.aclose()
    assert env.env_id == 5 and calls["register"] == 1
    assert env.runner.status.current_step == 2 and env.derived_batch_size == 8
