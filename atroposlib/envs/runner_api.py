"""The runner's calls to the rollout API: registration, W&B, ``/info`` and ``/status-env``.

:class:`RolloutAPICalls` is the part of :class:`~atroposlib.envs.runner.EnvRunner` that
talks to the rollout API through its :class:`~atroposlib.envs.api_client.RolloutAPIClient`
(``runner.api``, open while ``serve`` runs): register and wait for the trainer
(:meth:`~RolloutAPICalls.register`), join its W&B run, read ``batch_size`` and
``max_token_len`` from ``/info``, and poll ``/status-env`` in the background
(:meth:`~RolloutAPICalls.status_loop`), re-registering when the API forgot the env. The
one-shot calls (:meth:`~RolloutAPICalls.register_once`, :meth:`~RolloutAPICalls.post_now`)
also work outside ``serve`` with a temporary client.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import TYPE_CHECKING, Any, Dict

import httpx

from atroposlib.envs import scheduling
from atroposlib.envs import wandb_logging as wl
from atroposlib.envs.api_client import BadAnswer, RolloutAPIClient
from atroposlib.envs.background import PollFailures
from atroposlib.envs.serve import STATUS_POLL_S, Notice, registration_payload

if TYPE_CHECKING:
    from atroposlib.envs.hooks import EnvHooks

# The runner's own logger: the loop logs under one name, whichever part of it speaks.
logger = logging.getLogger("atroposlib.envs.runner")

__all__ = ["RolloutAPICalls"]


class RolloutAPICalls:
    """The rollout API side of :class:`~atroposlib.envs.runner.EnvRunner` (a base class of
    it; the attributes below are the runner's)."""

    env: EnvHooks
    api: RolloutAPIClient | None
    status: scheduling.EnvStatus | None
    derived_batch_size: int
    wake: asyncio.Event
    poll_failures: PollFailures

    def _api_or_temporary(self) -> RolloutAPIClient:
        return self.api or RolloutAPIClient(self.env.config.rollout_server_url)

    async def register_once(self) -> Dict[str, Any]:
        """One ``POST /register-env`` (no waiting for the trainer): the API's answer."""
        api = self._api_or_temporary()
        try:
            return await api.register_env(registration_payload(self.env))
        finally:
            if api is not self.api:
                await api.aclose()

    async def post_now(self, scored_data: Any) -> None:
        """POST one group or a list to the API now, bypassing the outbox; raises
        ``RuntimeError`` naming the status when the API does not accept it."""
        api = self._api_or_temporary()
        try:
            result = await api.post_scored(scored_data)
        finally:
            if api is not self.api:
                await api.aclose()
        if not result.ok:
            raise RuntimeError(
                f"the rollout API did not accept the scored data: status {result.status} "
                f"{result.detail}"
            )

    def _waiting_for_trainer(self, notice: Notice) -> None:
        notice("waiting for a trainer to register at %s (POST /register)", self._api_url())

    def _api_url(self) -> str:
        return self.api.base_url if self.api is not None else self.env.config.rollout_server_url

    async def setup_wandb(self) -> None:
        """Join the trainer's W&B project and group (waits until the trainer registered)."""
        env = self.env
        if not env.config.use_wandb:
            return
        api = self._require_api()
        trainer_notice, api_notice = Notice(), Notice()
        while True:
            try:
                info = await api.wandb_info()
                if info.get("project") is not None:
                    break
                self._waiting_for_trainer(trainer_notice)
            except (httpx.HTTPError, BadAnswer) as err:
                api_notice("rollout API at %s not reachable yet (%s)", api.base_url, err)
            await asyncio.sleep(1)
        env.wandb_project, env.wandb_group = info["project"], info.get("group")
        wl.init_run(
            env.wandb_project,
            env.wandb_group,
            wl.run_name(env.config.wandb_name),
            env.config.model_dump(mode="json"),
        )

    async def register(self) -> None:
        """Register with the rollout API, waiting until the trainer has started; adopt the
        env id, W&B name, starting step and checkpoint settings it answers."""
        env = self.env
        api = self._require_api()
        payload = registration_payload(env)
        failures = 0
        trainer_notice = Notice()
        while True:
            try:
                data = await api.register_env(payload)
            except httpx.HTTPStatusError as err:
                if err.response.status_code < 500:
                    raise RuntimeError(f"register-env refused: {err.response.text}") from err
                data = {"status": f"http {err.response.status_code}"}
            except (httpx.HTTPError, BadAnswer) as err:
                failures += 1
                logger.info("rollout API at %s not reachable yet (%s)", api.base_url, err)
                await asyncio.sleep(min(10.0, 0.5 * 2 ** min(failures, 5)))
                continue
            if data.get("status") == "success":
                break
            self._waiting_for_trainer(trainer_notice)
            await asyncio.sleep(1)
        env.env_id = data["env_id"]
        env.wandb_prepend = data.get("wandb_name")
        env.curr_step = int(data.get("starting_step", 0))
        env.checkpoint_dir = data.get("checkpoint_dir") or ""
        env.checkpoint_interval = int(data.get("checkpoint_interval", -1))
        if env.config.total_steps == -1:
            if int(data.get("num_steps", -1)) == -1:
                raise ValueError("total_steps is -1 and the rollout API has no num_steps")
            env.config.total_steps = int(data["num_steps"])
        logger.info(
            "registered as env %s (%s) at step %d", env.env_id, env.wandb_prepend, env.curr_step
        )
        if env.curr_step > 0:
            env.load_checkpoint()

    async def get_server_info(self) -> None:
        """Take ``batch_size`` and ``max_token_len`` from ``GET /info``."""
        env = self.env
        info = await self._require_api().info()
        if int(info.get("batch_size", -1)) != -1:
            env.config.batch_size = int(info["batch_size"])
        env.max_token_len = int(info.get("max_token_len", -1))
        if env.config.batch_size == -1:
            logger.warning("batch_size is unknown (-1); no workers start until it is set")
        elif env.config.group_size > env.config.batch_size:
            raise ValueError(
                f"group_size ({env.config.group_size}) is larger than batch_size "
                f"({env.config.batch_size})"
            )

    async def get_status(self) -> None:
        """Poll ``GET /status-env`` once and update the throttling state."""
        env = self.env
        payload = await self._require_api().status_env(env.env_id)  # type: ignore[arg-type]
        status = scheduling.EnvStatus.from_payload(payload)  # a bad answer changes nothing
        env.status_dict = payload
        self.status = status
        self.derived_batch_size = scheduling.derived_batch_size(
            env.config.batch_size, self.status, env.config.min_batch_allocation
        )
        if env.config.max_num_workers == -1:
            env.max_num_workers = env.config.max_num_workers_per_node * max(
                1, len(getattr(env.server, "servers", [1]))
            )
        else:
            env.max_num_workers = env.config.max_num_workers
        if env.config.inference_weight != -1 and hasattr(env.server, "update_weight"):
            # The original's update_weight is a coroutine; a user's server may still have a plain one.
            pending = env.server.update_weight(self.status.env_weight)
            if inspect.isawaitable(pending):
                await pending

    def _require_api(self) -> RolloutAPIClient:
        if self.api is None:
            raise RuntimeError("no rollout API client: this step runs inside serve mode")
        return self.api

    async def status_loop(self) -> None:
        """Poll ``/status-env`` (``env.get_status()``) until cancelled; re-register when the
        API answers 404 (it restarted and forgot this env).

        A poll that fails (no answer, an error status, a 2xx whose body is not a status) is
        logged with the answer's first bytes, counted (:attr:`poll_failures`) and retried
        with backoff; any other error ends the task, which stops the env
        (:func:`~atroposlib.envs.background.watch_task`).
        """
        env = self.env
        failures = self.poll_failures
        while True:
            try:
                await env.get_status()
                failures.success()
                self.wake.set()
            except httpx.HTTPStatusError as err:
                code = err.response.status_code
                loud = failures.failed(f"http_{code}")
                if code == 404:
                    logger.warning("rollout API forgot env %s; registering again", env.env_id)
                    await env.register_env()
                elif loud:
                    logger.warning("status-env failed (%d in a row): %s", failures.in_a_row, err)
            except httpx.HTTPError as err:
                if failures.failed("unreachable"):
                    logger.warning(
                        "rollout API at %s not reachable (status-env, %d tries): %s",
                        self._api_url(),
                        failures.in_a_row,
                        err,
                    )
            except (BadAnswer, scheduling.BadStatusAnswer) as err:
                if failures.failed("bad_answer"):
                    logger.warning(
                        "status-env answer unusable (%d in a row): %s", failures.in_a_row, err
                    )
            await asyncio.sleep(failures.delay(STATUS_POLL_S))
