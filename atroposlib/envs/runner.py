"""``EnvRunner``: the loop that drives an environment's hooks, and the state of that loop.

``BaseEnv`` holds the hooks an environment overrides (``get_next_item``,
``collect_trajectories``, ``evaluate`` ...) and the attributes environment files read
(``config``, ``server``, ``curr_step``, ``status_dict`` ...). What exists only while a
mode runs is owned here, by one object per env (``env.runner``): the rollout API
client, the group sender, the last ``/status-env`` answer, the wake event, the main
and status-poll tasks, the worker pool, the failure tracker and the server watch.

``serve`` (:meth:`EnvRunner.serve`): set up, join W&B, register with the rollout API,
then loop — poll ``/status-env`` in the background, run the step-change hooks, stop
at ``total_steps``, pause when enough data is queued (off-policy limit) or the API is
failing, otherwise top up the workers. ``process`` and ``evaluate`` run without the
API (:mod:`atroposlib.envs.offline`). The calls to the rollout API (register, W&B,
``/info``, the ``/status-env`` poll) are :class:`~atroposlib.envs.runner_api.RolloutAPICalls`,
a base class of the runner.

The runner calls the env's methods by their original names (``env.register_env()``,
``env.get_status()``, ``env.env_step_checks()``, ``env.add_train_workers()``,
``env.handle_env(uuid)`` ...), so a subclass that overrides one changes what the loop
does; the defaults of those methods hand back to the runner.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Dict, Tuple

from atroposlib.envs import offline, scheduling
from atroposlib.envs.api_client import RolloutAPIClient
from atroposlib.envs.background import PollFailures, watch_task
from atroposlib.envs.config import EvalHandlingEnum
from atroposlib.envs.health import (
    FailureTracker,
    ServerWatch,
    TooManyFailuresError,
    bounded,
    server_urls,
)
from atroposlib.envs.outbox import Outbox, default_outbox_dir
from atroposlib.envs.runner_api import RolloutAPICalls
from atroposlib.envs.sender import GroupSender
from atroposlib.envs.serve import MAINLOOP_TICK_S, install_stop_signals
from atroposlib.envs.server_handling.policy_version import recording_versions, stamp_group
from atroposlib.envs.server_handling.sampling_record import recording_sampling, stamp_sampling
from atroposlib.envs.workers import WorkerPool
from atroposlib.utils.aio import cancel_and_wait
from atroposlib.utils.gc_tuning import startup_objects_frozen

if TYPE_CHECKING:
    from pathlib import Path

    from atroposlib.envs.hooks import EnvHooks

logger = logging.getLogger(__name__)


class EnvRunner(RolloutAPICalls):
    """Runs one environment in ``serve``, ``process`` or ``evaluate`` mode.

    Created by ``BaseEnv.__init__`` as ``env.runner``; the env's ``env_manager()``,
    ``process_manager()`` and ``run_evaluate()`` call :meth:`serve`, :meth:`process`
    and :meth:`evaluate`. ``write_report`` renders the ``process`` jsonl as html
    (default: :func:`atroposlib.envs.offline.html_report`); set it to another
    ``async (path) -> None`` to change or skip the report.
    """

    FAILED: Any = object()
    """What :meth:`next_item` gives when ``get_next_item`` raised (None: no more items)."""

    def __init__(self, env: EnvHooks) -> None:
        self.env = env
        self.wake = asyncio.Event()
        self.pool = WorkerPool(on_done=self.wake.set)
        self.api: RolloutAPIClient | None = None
        self.sender: GroupSender | None = None
        self.status: scheduling.EnvStatus | None = None
        self.derived_batch_size = -1
        self.eval_task: asyncio.Task | None = None
        # Failure handling: backoff, the consecutive-failure limit, the server watch.
        self.failures = FailureTracker(getattr(env.config, "max_consecutive_failures", 20))
        self.server_watch: ServerWatch | None = None
        self.fatal_error: BaseException | None = None
        self.write_report: Callable[[Path], Awaitable[None]] = offline.html_report
        self._status_task: asyncio.Task | None = None
        self.poll_failures = PollFailures()
        self._main_task: asyncio.Task | None = None
        self._last_reap = 0.0
        self._stop_requested = False
        self._serving = False

    # ------------------------------------------------------------ failures

    def record_failure(self, err: BaseException, where: str) -> None:
        """Count a failure (with backoff when transient); past the limit, stop the env.

        While the server watch sees every inference server down, failures are not
        counted: the outage has its own budget (``max_server_downtime``).
        """
        count = self.server_watch is None or not self.server_watch.all_down
        try:
            self.failures.record_failure(err, where, count=count)
        except TooManyFailuresError as fatal:
            self.stop_with_error(fatal)

    async def attempt(
        self, where: str, call: Callable[[], Awaitable[Any]], failed: Any, message: str
    ) -> Any:
        """``await call()``; should it raise, log ``message`` with the traceback, count the
        failure at ``where`` (:meth:`record_failure`) and give ``failed`` instead."""
        try:
            return await call()
        except asyncio.CancelledError:
            raise
        except Exception as err:
            logger.exception(message)
            self.record_failure(err, where)
            return failed

    def stop_with_error(self, err: BaseException) -> None:
        """Make the running ``serve``/``process`` loop stop and raise ``err``."""
        if self.fatal_error is None:
            self.fatal_error = err
        self.wake.set()

    def raise_if_fatal(self) -> None:
        """Raise the error that stopped the env, if any."""
        if self.fatal_error is not None:
            raise self.fatal_error

    def can_start_work(self) -> bool:
        """False while a failure backoff is pending or every inference server is down."""
        if self.server_watch is not None and self.server_watch.all_down:
            return False
        return self.failures.ready()

    def start_server_watch(self) -> None:
        """Probe the inference servers in the background (not for mock/testing servers)."""
        if self.env.testing or self.server_watch is not None:
            return
        self.server_watch = ServerWatch(
            server_urls(self.env.server),
            float(getattr(self.env.config, "max_server_downtime", 600)),
            self.stop_with_error,
        )
        self.server_watch.start()

    async def stop_server_watch(self) -> None:
        """Stop the background probes."""
        if self.server_watch is not None:
            await self.server_watch.stop()

    def rejected(self) -> Dict[str, int]:
        """Groups and items dropped below the env's own checks: by the sender (refused by
        the API) and by the pool (workers that timed out twice), per reason."""
        counts: Dict[str, int] = dict(self.sender.rejected) if self.sender is not None else {}
        if self.pool.timed_out_dropped:
            counts["worker_timeout"] = self.pool.timed_out_dropped
        return counts

    # ------------------------------------------------------------- workers

    def worker_cap(self) -> int:
        """How many training workers may run now (eval handling, off-policy room, quotas)."""
        env = self.env
        eval_running = self.eval_task is not None and not self.eval_task.done()
        return scheduling.train_worker_cap(
            max_num_workers=env.max_num_workers,
            eval_running=eval_running,
            eval_handling=env.config.eval_handling.value,
            eval_limit_ratio=env.config.eval_limit_ratio,
            max_batches_offpolicy=env.config.max_batches_offpolicy,
            derived_batch=env.derived_batch_size,
            group_size=env.config.group_size,
            status=self.status or scheduling.EnvStatus(),
            min_batch_allocation=env.config.min_batch_allocation,
            batch_size=env.config.batch_size,
        )

    async def add_train_workers(self) -> None:
        """Start workers (``env.handle_env``) up to the current cap; re-queued items
        first, then the backlog (FIFO), then ``env.get_next_item()``."""
        env = self.env
        cap = self.worker_cap()
        self.pool.park_excess(cap)
        added = 0
        while len(self.pool) < cap:
            if self.pool.requeue:
                item, timeouts = self.pool.requeue.popleft()
            elif env.backlog:
                item, timeouts = env.backlog.pop(0), 0
            else:
                item, timeouts = await self.next_item(), 0
                if item is None or item is self.FAILED:
                    break
            self.pool.spawn(item, env.handle_env, timeouts=timeouts)
            added += 1
        env.workers_added_list.append(added)

    async def next_item(self) -> Any:
        """``env.get_next_item()``; a failure is logged and counted and gives :attr:`FAILED`."""
        return await self.attempt(
            "get_next_item", self.env.get_next_item, self.FAILED, "get_next_item failed"
        )

    async def collect(self, item: Any) -> Tuple[Any, Any]:
        """``env.collect_trajectories(item)``, each group it returns stamped with the policy
        versions and the sampling parameters of the requests that made it (docs/design.md,
        "Policy versions and staleness")."""
        with recording_versions() as versions_seen, recording_sampling() as sampled:
            result, backlog = await self.env.collect_trajectories(item)
        for group in result if isinstance(result, list) else [result]:
            stamp_group(group, versions_seen)
            stamp_sampling(group, sampled)
        return result, backlog

    async def run_item(self, item_uuid: str) -> None:
        """One worker: collect, postprocess, send, clean up (what ``env.handle_env`` runs)."""
        env = self.env
        item = self.pool.running[item_uuid]["item"]
        started = time.time()
        result: Any = None
        try:
            result, backlog = await self.collect(item)
            env.backlog.extend(backlog or [])
            if result is not None:
                result = await env.postprocess_histories(result)
            self.failures.record_success()
        except asyncio.CancelledError:
            raise
        except Exception as err:
            logger.exception("collect_trajectories failed for an item")
            self.record_failure(err, "collect_trajectories")
            result = None
        duration = time.time() - started
        env.task_duration.append(duration)
        (env.succeeded_task_duration if result is not None else env.failed_task_duration).append(
            duration
        )
        self.pool.mark_sending(item_uuid)
        try:
            if result is not None:
                await env.handle_send_to_api(result, item)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("handle_send_to_api failed; the group is dropped")
            env.items_rejected["send_error"] += 1
        finally:
            await env.cleanup()
            self.pool.release(asyncio.current_task())

    async def send(self, payload: Any) -> None:
        """Hand validated groups to the sender (delivered in order, outbox as fallback)."""
        if self.sender is None:
            raise RuntimeError("handle_send_to_api(do_send_to_api=True) needs a running serve loop")
        await self.sender.send(payload, wait=False)

    async def env_step_checks(self) -> None:
        """On a trainer step change: start evals, save checkpoints, log metrics."""
        env = self.env
        if self.status is None:
            return
        old, new = env.curr_step, self.status.current_step
        if new == old:
            return
        spe = env.config.steps_per_eval
        if spe > 0 and (new // spe) > (old // spe):
            if self.eval_task is not None and not self.eval_task.done():
                logger.warning(
                    "previous evaluation still running; skipping the one at step %d", new
                )
            else:
                if env.config.eval_handling == EvalHandlingEnum.STOP_TRAIN:
                    self.pool.park_all()
                self.eval_task = asyncio.create_task(self._run_eval())
        interval = env.checkpoint_interval
        if interval > 0 and (new // interval) > (old // interval):
            env.save_checkpoint((new // interval) * interval)
        env.curr_step = new
        if env.items_sent_this_step >= env.config.min_items_sent_before_logging:
            env.items_sent_this_step = 0
            await env.wandb_log({})

    async def _run_eval(self) -> None:
        """``env.evaluate()`` as a background task; its errors are logged, not raised."""
        try:
            await self.env.evaluate()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("evaluate() failed")

    # ---------------------------------------------------------------- modes

    async def serve(self) -> None:
        """The ``serve`` lifecycle: register, then keep workers busy until ``total_steps``.

        SIGINT/SIGTERM stop it gracefully: groups already made are delivered (or
        kept in the outbox) before it returns.
        """
        env = self.env
        self._main_task = asyncio.current_task()
        uninstall = install_stop_signals(self.request_stop)
        self.api = RolloutAPIClient(env.config.rollout_server_url)
        try:
            await env.setup()
            await env.setup_wandb()
            await env.register_env()
            await env.get_server_info()
            outbox_dir = default_outbox_dir(env.config.wandb_name or env.name)
            outbox = Outbox(outbox_dir)
            outbox.adopt_orphans(outbox_dir.parent, outbox_dir.name.rsplit("-", 1)[0])
            self.sender = GroupSender(self.api, outbox)
            self.sender.start()
            for task, what in self.sender.tasks():
                watch_task(task, what, self.stop_with_error)
            self._status_task = asyncio.create_task(self.status_loop(), name="atropos-status-poll")
            watch_task(self._status_task, "status-poll", self.stop_with_error)
            self.start_server_watch()
            if self.server_watch is not None and self.server_watch.urls:
                await self.server_watch.check_once()  # start no worker on a server not up yet
            self._serving = True
            with startup_objects_frozen():
                await self._serve_loop()
        except asyncio.CancelledError:
            if not self._stop_requested:
                raise
            logger.info("stopped before serving started")
        finally:
            uninstall()
            await self._shutdown()

    async def _serve_loop(self) -> None:
        env = self.env
        while True:
            started = time.perf_counter()
            self.wake.clear()
            self.raise_if_fatal()
            if self._stop_requested:
                return
            status = self.status
            if status is not None:
                await env.env_step_checks()
                if scheduling.should_terminate(
                    status, env.config.group_size, env.config.batch_size, env.config.total_steps
                ):
                    logger.info(
                        "enough data queued for total_steps=%d; stopping", env.config.total_steps
                    )
                    return
                if time.monotonic() - self._last_reap >= 1.0:
                    self._last_reap = time.monotonic()
                    self.pool.reap_timeouts(env.config.worker_timeout)
                paused = env.derived_batch_size == -1 or scheduling.offpolicy_full(
                    status,
                    env.config.group_size,
                    env.config.batch_size,
                    env.config.max_batches_offpolicy,
                    env.config.min_batch_allocation,
                )
                if paused:
                    self.pool.park_all()
                elif self.sender is not None and (self.sender.degraded or len(self.sender.outbox)):
                    pass  # the API is not taking data: do not pile up more groups
                elif not self.can_start_work():
                    pass  # backing off after failures, or every inference server is down
                elif len(self.pool) < env.max_num_workers or self.pool.requeue:
                    await env.add_train_workers()
                env.mainloop_timings.append(time.perf_counter() - started)
            # Wake on a finished worker or a fresh status, at the latest after one tick
            # (a timer handle is cheaper than wait_for's extra task at ~1000 wakes/s).
            tick = asyncio.get_running_loop().call_later(MAINLOOP_TICK_S, self.wake.set)
            await self.wake.wait()
            tick.cancel()

    async def _shutdown(self) -> None:
        env = self.env
        await bounded(self.stop_server_watch(), "stopping the server watch")
        self.pool.park_all()
        await self.pool.wait_all(timeout_s=120)
        for task in (self._status_task, self.eval_task):
            if task is not None and not task.done():
                await cancel_and_wait(task)  # a poll may swallow one cancellation
        if self.sender is not None:
            await self.sender.close(drain_timeout_s=60)
        if self.api is not None:
            if env.env_id is not None:
                await self.api.disconnect_env(env.env_id)
            await self.api.aclose()
        if env.jsonl_writer is not None:
            env.jsonl_writer.close()
        await bounded(env.close_servers(), "closing the inference servers")
        if self.poll_failures.by_kind:
            logger.info("failed status-env polls by kind: %s", dict(self.poll_failures.by_kind))
        rejected = env.all_rejections()
        if rejected:
            logger.info("dropped groups/items by reason: %s", dict(rejected))

    def request_stop(self) -> None:
        """Stop the serve loop gracefully: finish sending, drain the outbox, disconnect."""
        if not self._stop_requested:
            logger.info("stop requested; delivering what is in flight, then exiting")
        self._stop_requested = True
        self.wake.set()
        if not self._serving and self._main_task is not None:
            self._main_task.cancel()  # still setting up or registering: nothing to deliver

    async def process(self) -> None:
        """The ``process`` mode: roll out ``n_groups_to_process`` groups to jsonl + html."""
        await offline.run_process(self)

    async def evaluate(self) -> None:
        """The ``evaluate`` mode: ``setup()`` then ``evaluate()`` once."""
        await offline.run_evaluate(self)
