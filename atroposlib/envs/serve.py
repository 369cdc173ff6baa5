"""The ``serve`` mode of an environment: the loop that keeps rollout workers busy.

``BaseEnv.env_manager`` runs :func:`env_manager`: set up, join W&B, register with
the rollout API, then loop — poll ``/status-env`` in the background, run the
step-change hooks, stop at ``total_steps``, pause when enough data is queued
(off-policy limit) or the API is failing, otherwise top up the workers. Each
step is a function of the env so subclasses can still override the original
method names (``register_env``, ``get_status``, ``env_step_checks`` ...).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
import time
from typing import TYPE_CHECKING, Any

import httpx

from atroposlib.envs import scheduling
from atroposlib.envs import wandb_logging as wl
from atroposlib.envs.api_client import RolloutAPIClient
from atroposlib.envs.config import EvalHandlingEnum
from atroposlib.envs.health import bounded
from atroposlib.envs.outbox import Outbox, default_outbox_dir
from atroposlib.envs.sender import GroupSender

if TYPE_CHECKING:
    from atroposlib.envs.base import BaseEnv

logger = logging.getLogger(__name__)

STATUS_POLL_S = 0.1
MAINLOOP_TICK_S = 0.1
WAITING_NOTICE_S = 30.0


class _Notice:
    """Logs a waiting message once, then again every ``every`` seconds."""

    def __init__(self, every: float = WAITING_NOTICE_S) -> None:
        self.every = every
        self._last: float | None = None

    def __call__(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        if self._last is None or now - self._last >= self.every:
            self._last = now
            logger.info(message, *args)


def _waiting_for_trainer(env: BaseEnv, notice: _Notice) -> None:
    notice(
        "waiting for a trainer to register at %s (POST /register)",
        env._api.base_url,  # type: ignore[union-attr]
    )


async def setup_wandb(env: BaseEnv) -> None:
    """Join the trainer's W&B project and group (waits until the trainer registered)."""
    if not env.config.use_wandb:
        return
    trainer_notice, api_notice = _Notice(), _Notice()
    while True:
        try:
            info = await env._api.wandb_info()  # type: ignore[union-attr]
            if info.get("project") is not None:
                break
            _waiting_for_trainer(env, trainer_notice)
        except httpx.HTTPError as err:
            api_notice(
                "rollout API at %s not reachable yet (%s)",
                env._api.base_url,  # type: ignore[union-attr]
                err,
            )
        await asyncio.sleep(1)
    env.wandb_project, env.wandb_group = info["project"], info.get("group")
    wl.init_run(
        env.wandb_project,
        env.wandb_group,
        wl.run_name(env.config.wandb_name),
        env.config.model_dump(mode="json"),
    )


def registration_payload(env: BaseEnv) -> dict[str, Any]:
    """The ``/register-env`` body of ``env``."""
    return {
        "max_token_length": env.config.max_token_length,
        "desired_name": env.config.wandb_name or env.name or type(env).__name__,
        "weight": env.config.inference_weight,
        "min_batch_allocation": env.config.min_batch_allocation,
        "group_size": env.config.group_size,
    }


async def register_env(env: BaseEnv) -> None:
    """Register with the rollout API, waiting until the trainer has started."""
    payload = registration_payload(env)
    failures = 0
    trainer_notice = _Notice()
    while True:
        try:
            data = await env._api.register_env(payload)  # type: ignore[union-attr]
        except httpx.HTTPStatusError as err:
            if err.response.status_code < 500:
                raise RuntimeError(f"register-env refused: {err.response.text}") from err
            data = {"status": f"http {err.response.status_code}"}
        except httpx.HTTPError as err:
            failures += 1
            logger.info(
                "rollout API at %s not reachable yet (%s)",
                env._api.base_url,  # type: ignore[union-attr]
                err,
            )
            await asyncio.sleep(min(10.0, 0.5 * 2 ** min(failures, 5)))
            continue
        if data.get("status") == "success":
            break
        _waiting_for_trainer(env, trainer_notice)
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


async def get_server_info(env: BaseEnv) -> None:
    """Take ``batch_size`` and ``max_token_len`` from ``GET /info``."""
    info = await env._api.info()  # type: ignore[union-attr]
    if int(info.get("batch_size", -1)) != -1:
        env.config.batch_size = int(info["batch_size"])
    env.max_token_len = int(info.get("max_token_len", -1))
    if env.config.batch_size == -1:
        logger.warning("batch_size is unknown (-1); no workers start until it is set")
    elif env.config.group_size > env.config.batch_size:
        raise ValueError(
            f"group_size ({env.config.group_size}) is larger than batch_size ({env.config.batch_size})"
        )


async def get_status(env: BaseEnv) -> None:
    """Poll ``GET /status-env`` once and update the throttling state."""
    payload = await env._api.status_env(env.env_id)  # type: ignore[union-attr, arg-type]
    env.status_dict = payload
    env._status = scheduling.EnvStatus.from_payload(payload)
    env.derived_batch_size = scheduling.derived_batch_size(
        env.config.batch_size, env._status, env.config.min_batch_allocation
    )
    if env.config.max_num_workers == -1:
        env.max_num_workers = env.config.max_num_workers_per_node * max(
            1, len(getattr(env.server, "servers", [1]))
        )
    else:
        env.max_num_workers = env.config.max_num_workers
    if env.config.inference_weight != -1 and hasattr(env.server, "update_weight"):
        # The original's update_weight is a coroutine; a user's server may still have a plain one.
        pending = env.server.update_weight(env._status.env_weight)
        if inspect.isawaitable(pending):
            await pending


async def status_loop(env: BaseEnv) -> None:
    failures = 0
    while True:
        try:
            await env.get_status()
            failures = 0
            env._wake.set()
        except httpx.HTTPStatusError as err:
            failures += 1
            if err.response.status_code == 404:
                logger.warning("rollout API forgot env %s; registering again", env.env_id)
                await env.register_env()
            else:
                logger.warning("status-env failed: %s", err)
        except httpx.HTTPError as err:
            failures += 1
            if failures in (1, 10) or failures % 100 == 0:
                logger.warning(
                    "rollout API at %s not reachable (status-env, %d tries): %s",
                    env._api.base_url,  # type: ignore[union-attr]
                    failures,
                    err,
                )
        await asyncio.sleep(STATUS_POLL_S if failures == 0 else min(2.0, STATUS_POLL_S * failures))


async def env_step_checks(env: BaseEnv) -> None:
    """On a trainer step change: start evals, save checkpoints, log metrics (§4.7)."""
    if env._status is None:
        return
    old, new = env.curr_step, env._status.current_step
    if new == old:
        return
    spe = env.config.steps_per_eval
    if spe > 0 and (new // spe) > (old // spe):
        if env.eval_runner is not None and not env.eval_runner.done():
            logger.warning("previous evaluation still running; skipping the one at step %d", new)
        else:
            if env.config.eval_handling == EvalHandlingEnum.STOP_TRAIN:
                env.pool.park_all()
            env.eval_runner = asyncio.create_task(run_eval(env))
    interval = env.checkpoint_interval
    if interval > 0 and (new // interval) > (old // interval):
        env.save_checkpoint((new // interval) * interval)
    env.curr_step = new
    if env.items_sent_this_step >= env.config.min_items_sent_before_logging:
        env.items_sent_this_step = 0
        await env.wandb_log({})


async def run_eval(env: BaseEnv) -> None:
    """Run ``env.evaluate()`` as a background task; its errors are logged, not raised."""
    try:
        await env.evaluate()
    except asyncio.CancelledError:
        raise
    except Exception:
        logger.exception("evaluate() failed")


async def env_manager(env: BaseEnv) -> None:
    """The ``serve`` lifecycle: register, then keep workers busy until ``total_steps``.

    SIGINT/SIGTERM stop it gracefully: groups already made are delivered (or
    kept in the outbox) before it returns.
    """
    env._main_task = asyncio.current_task()
    uninstall = _install_stop_signals(env.request_stop)
    env._api = RolloutAPIClient(env.config.rollout_server_url)
    try:
        await env.setup()
        await env.setup_wandb()
        await env.register_env()
        await env.get_server_info()
        outbox_dir = default_outbox_dir(env.config.wandb_name or env.name)
        outbox = Outbox(outbox_dir)
        outbox.adopt_orphans(outbox_dir.parent, outbox_dir.name.rsplit("-", 1)[0])
        env._sender = GroupSender(env._api, outbox)
        env._sender.start()
        env._status_task = asyncio.create_task(status_loop(env), name="atropos-status-poll")
        env.start_server_watch()
        if env.server_watch is not None and env.server_watch.urls:
            await env.server_watch.check_once()  # start no worker on a server not up yet
        env._serving = True
        await serve_loop(env)
    except asyncio.CancelledError:
        if not env._stop_requested:
            raise
        logger.info("stopped before serving started")
    finally:
        uninstall()
        await shutdown(env)


async def serve_loop(env: BaseEnv) -> None:
    while True:
        started = time.perf_counter()
        env._wake.clear()
        env.raise_if_fatal()
        if env._stop_requested:
            return
        status = env._status
        if status is not None:
            await env.env_step_checks()
            if scheduling.should_terminate(
                status, env.config.group_size, env.config.batch_size, env.config.total_steps
            ):
                logger.info(
                    "enough data queued for total_steps=%d; stopping", env.config.total_steps
                )
                return
            if time.monotonic() - env._last_reap >= 1.0:
                env._last_reap = time.monotonic()
                env.pool.reap_timeouts(env.config.worker_timeout)
            paused = env.derived_batch_size == -1 or scheduling.offpolicy_full(
                status,
                env.config.group_size,
                env.config.batch_size,
                env.config.max_batches_offpolicy,
                env.config.min_batch_allocation,
            )
            if paused:
                env.pool.park_all()
            elif env._sender is not None and (env._sender.degraded or len(env._sender.outbox)):
                pass  # the API is not taking data: do not pile up more groups
            elif not env.can_start_work():
                pass  # backing off after failures, or every inference server is down
            elif len(env.pool) < env.max_num_workers or env.pool.requeue:
                await env.add_train_workers()
            env.mainloop_timings.append(time.perf_counter() - started)
        # Wake on a finished worker or a fresh status, at the latest after one tick
        # (a timer handle is cheaper than wait_for's extra task at ~1000 wakes/s).
        tick = asyncio.get_running_loop().call_later(MAINLOOP_TICK_S, env._wake.set)
        await env._wake.wait()
        tick.cancel()


async def shutdown(env: BaseEnv) -> None:
    await bounded(env.stop_server_watch(), "stopping the server watch")
    env.pool.park_all()
    await env.pool.wait_all(timeout_s=120)
    for task in (env._status_task, env.eval_runner):
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if env._sender is not None:
        await env._sender.close(drain_timeout_s=60)
    if env._api is not None:
        if env.env_id is not None:
            await env._api.disconnect_env(env.env_id)
        await env._api.aclose()
    if env.jsonl_writer is not None:
        env.jsonl_writer.close()
    await bounded(env.close_servers(), "closing the inference servers")
    rejected = env.all_rejections()
    if rejected:
        logger.info("dropped groups/items by reason: %s", dict(rejected))


def _install_stop_signals(callback: Any) -> Any:
    """Route SIGINT/SIGTERM to ``callback`` while serving; returns the undo function."""
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, callback)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread, or no signal support on this platform

    def uninstall() -> None:
        for sig in installed:
            loop.remove_signal_handler(sig)

    return uninstall
