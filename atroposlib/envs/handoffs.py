"""The original ``BaseEnv``'s loop methods, each handing over to the runner.

The loop runs in :class:`~atroposlib.envs.runner.EnvRunner` (``env.runner``).
Environment files written for the original Atropos call these methods, read these
attributes and override them by name, and the runner calls each step by its name on
the environment, so an override takes effect. :class:`RunnerHandoffs` is that
compatibility surface, in one place: every member is a one-line hand-off. ``BaseEnv``
inherits it; the hooks an environment implements live in ``base``.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Dict

if TYPE_CHECKING:
    from atroposlib.envs.runner import EnvRunner

__all__ = ["RunnerHandoffs"]


class RunnerHandoffs:
    """The loop's steps, modes and loop state under the original's names (see the module)."""

    runner: EnvRunner

    # ----------------------------------------------------- the loop's steps

    async def handle_env(self, item_uuid: str) -> None:
        """Run one item: collect, postprocess, send, clean up."""
        await self.runner.run_item(item_uuid)

    async def add_train_workers(self) -> None:
        """Start workers up to the current cap; backlog items first (FIFO)."""
        await self.runner.add_train_workers()

    @property
    def workers(self) -> set:
        """The live rollout worker tasks (sending ones included)."""
        return self.runner.pool.tasks

    @property
    def running_items(self) -> Dict[str, Dict[str, Any]]:
        """``uuid -> {"item", "worker", "start_time", "timeouts"}`` of collecting workers."""
        return self.runner.pool.running

    @property
    def eval_runner(self) -> asyncio.Task | None:
        """The running (or last) evaluation task started on a step change."""
        return self.runner.eval_task

    @eval_runner.setter
    def eval_runner(self, task: asyncio.Task | None) -> None:
        self.runner.eval_task = task

    @property
    def derived_batch_size(self) -> int:
        """This env's share of the trainer's batch, from the API's status (``-1`` before
        the first status poll); ``min_batch_allocation`` raises it."""
        return self.runner.derived_batch_size

    @derived_batch_size.setter
    def derived_batch_size(self, value: int) -> None:
        self.runner.derived_batch_size = int(value)

    async def _register_env(self) -> Dict[str, Any]:
        """One ``POST /register-env`` attempt (no waiting for the trainer): the API's answer.

        :meth:`register_env` repeats it until the trainer has registered.
        """
        return await self.runner.register_once()

    async def _send_scored_data_to_api(self, scored_data: Any) -> None:
        """POST one group (a dict) or several (a list) to the API now, bypassing the outbox;
        raises ``RuntimeError`` naming the status when the API does not accept it."""
        await self.runner.post_now(scored_data)

    async def setup_wandb(self) -> None:
        """Join the trainer's W&B project and group (waits until the trainer registered)."""
        await self.runner.setup_wandb()

    async def register_env(self) -> None:
        """Register with the rollout API, waiting until the trainer has started."""
        await self.runner.register()

    async def get_server_info(self) -> None:
        """Take ``batch_size`` and ``max_token_len`` from ``GET /info``."""
        await self.runner.get_server_info()

    async def get_status(self) -> None:
        """Poll ``GET /status-env`` once and update the throttling state."""
        await self.runner.get_status()

    async def env_step_checks(self) -> None:
        """On a trainer step change: start evals, save checkpoints, log metrics."""
        await self.runner.env_step_checks()

    # ------------------------------------------------------------------ modes

    async def env_manager(self) -> None:
        """The ``serve`` mode: register, then keep workers busy until ``total_steps``.

        SIGINT/SIGTERM stop it gracefully: groups already made are delivered (or
        kept in the outbox) before it returns.
        """
        await self.runner.serve()

    async def process_manager(self) -> None:
        """The ``process`` mode: roll out ``n_groups_to_process`` groups to jsonl + html, no API."""
        await self.runner.process()

    async def run_evaluate(self) -> None:
        """The ``evaluate`` mode: ``setup()`` then ``evaluate()`` once."""
        await self.runner.evaluate()

    async def _run_evaluate(self) -> None:
        """The original's name of :meth:`run_evaluate` (what ``evaluate`` mode runs)."""
        await self.run_evaluate()
