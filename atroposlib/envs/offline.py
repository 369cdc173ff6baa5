"""The ``process`` and ``evaluate`` modes: run an environment without the rollout API.

:class:`~atroposlib.envs.runner.EnvRunner` calls :func:`run_process` and
:func:`run_evaluate` with itself: the env's hooks are reached through ``runner.env``,
failure handling through the runner.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Set

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from atroposlib.envs import wandb_logging as wl
from atroposlib.envs.health import bounded

if TYPE_CHECKING:
    from atroposlib.envs.hooks import EnvHooks, RunnerView

logger = logging.getLogger(__name__)


def _progress(total: int | None) -> Progress:
    columns = [SpinnerColumn(), TextColumn("{task.description}")]
    if total is not None:
        columns += [BarColumn(), MofNCompleteColumn()]
    columns.append(TimeElapsedColumn())
    return Progress(*columns, console=Console(stderr=True), transient=False)


def _concurrency(env: EnvHooks) -> int:
    if env.config.max_num_workers > 0:
        return env.config.max_num_workers
    servers = len(getattr(env.server, "servers", []) or [1])
    return max(1, env.config.max_num_workers_per_node * servers)


class ProcessFailedError(RuntimeError):
    """``process`` mode ended without writing a group, and groups or items failed."""


async def _next_item(runner: RunnerView) -> Any:
    """The next item (backlog first); failures are counted and give ``runner.FAILED``."""
    env = runner.env
    if env.backlog:
        return env.backlog.pop(0)
    return await runner.next_item()


async def _collect(runner: RunnerView, item: Any) -> Any:
    """The groups of ``item``, stamped; None when ``collect_trajectories`` raised (counted)."""
    collected = await runner.attempt(
        "collect_trajectories",
        lambda: runner.collect(item),
        runner.FAILED,
        "collect_trajectories failed; trying the next item",
    )
    if collected is runner.FAILED:
        return None
    result, backlog = collected
    runner.failures.record_success()
    runner.env.backlog.extend(backlog or [])
    return result


async def run_process(runner: RunnerView) -> None:
    """Roll out ``n_groups_to_process`` groups concurrently and write them to jsonl (then html).

    Items run ``max_num_workers`` at a time (or ``max_num_workers_per_node`` per
    server). A group counts when ``collect_trajectories`` returned something; an
    empty result is retried with the next item, as in the original. A failing
    item delays the next ones (backoff on transient errors) and, after
    ``max_consecutive_failures`` failures in a row, ends the run with an error.
    """
    env = runner.env
    env.process_mode = True
    await env.setup()
    if env.config.use_wandb:
        wl.init_run(
            None, None, wl.run_name(env.name or "process"), env.config.model_dump(mode="json")
        )
    target = (
        env.n_groups_to_process if env.n_groups_to_process is not None else env.config.total_steps
    )
    limit = _concurrency(env)
    in_flight: Set[asyncio.Task] = set()
    exhausted = False
    runner.start_server_watch()
    try:
        with _progress(target) as progress:
            bar = progress.add_task("groups", total=target)
            while True:
                runner.raise_if_fatal()
                while (
                    runner.can_start_work()
                    and not exhausted
                    and len(in_flight) < limit
                    and env.curr_step + len(in_flight) < target
                ):
                    item = await _next_item(runner)
                    runner.raise_if_fatal()
                    if item is runner.FAILED:
                        break
                    if item is None:
                        exhausted = True
                        break
                    in_flight.add(asyncio.create_task(_collect(runner, item)))
                if not in_flight:
                    if exhausted or env.curr_step >= target:
                        break
                    await asyncio.sleep(0.05 if runner.can_start_work() else 0.25)
                    continue
                done, in_flight = await asyncio.wait(
                    in_flight, timeout=1.0, return_when=asyncio.FIRST_COMPLETED
                )
                for task in done:
                    await _handle_result(env, task.result(), target)
                    progress.update(bar, completed=env.curr_step)
        runner.raise_if_fatal()
    finally:
        for task in in_flight:
            task.cancel()
        await asyncio.gather(*in_flight, return_exceptions=True)
        await bounded(runner.stop_server_watch(), "stopping the server watch")
        await bounded(env.close_servers(), "closing the inference servers")
    if env.curr_step < target:
        logger.warning("get_next_item ran out after %d of %d groups", env.curr_step, target)
    await _finish_files(runner)


async def _handle_result(env: EnvHooks, result: Any, target: int) -> None:
    if not result or env.curr_step >= target:
        if not result:
            logger.info("no group from that item; retrying with the next one")
        return
    result = await env.postprocess_histories(result)
    await env.handle_send_to_api(
        result, None, do_send_to_api=False, abort_on_any_max_length_exceeded=False
    )
    await env.wandb_log()
    env.curr_step += 1


async def _finish_files(runner: RunnerView) -> None:
    env = runner.env
    if env.jsonl_writer is None:
        failed = env.all_rejections()
        failed.pop("scores_all_equal", None)
        if runner.failures.total or sum(failed.values()):
            raise ProcessFailedError(
                f"no group was written: {runner.failures.total} failures, "
                f"groups dropped by reason: {dict(failed) or 'none'}"
            )
        logger.warning("no group was written")
        return
    env.jsonl_writer.close()
    path = env.jsonl_writer.path
    logger.info("%d groups written to %s", env.jsonl_writer.lines, path)
    await runner.write_report(Path(path))


REPORT_MODULE = "atroposlib.frontend.jsonl2html"


async def html_report(jsonl_path: Path) -> None:
    """Write ``<stem>.html`` beside ``jsonl_path`` with the frontend's report command.

    The frontend sits above environments in the package layering (it reads what they
    write), so ``process`` hands it the file through its command line,
    ``python -m atroposlib.frontend.jsonl2html IN OUT``, in a child process, instead
    of importing it. Raises :class:`ProcessFailedError` when the report cannot be
    written; a report with no renderable group is only logged.
    """
    html = jsonl_path.with_suffix(".html")
    # The child must import this same atroposlib, also when the env file put it on sys.path.
    package_root = str(Path(__file__).resolve().parents[2])
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        REPORT_MODULE,
        str(jsonl_path),
        str(html),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=child_env,
    )
    out, err = await proc.communicate()
    message = (err or out).decode(errors="replace").strip()
    if proc.returncode == 0:
        logger.info("html view written to %s", html)
    elif proc.returncode == 1:  # written, but no group had messages to show
        logger.warning("html view %s is empty: %s", html, message)
    else:
        raise ProcessFailedError(f"the html view of {jsonl_path} was not written: {message}")


async def run_evaluate(runner: RunnerView) -> None:
    """``setup()`` then ``evaluate()`` once, with a progress spinner."""
    env = runner.env
    await env.setup()
    if env.config.use_wandb:
        wl.init_run(
            None, None, wl.run_name(env.name or "evaluate"), env.config.model_dump(mode="json")
        )
    with _progress(None) as progress:
        progress.add_task("evaluating", total=None)
        try:
            await env.evaluate()
        finally:
            await env.close_servers()
