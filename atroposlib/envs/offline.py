"""The ``process`` and ``evaluate`` modes: run an environment without the rollout API (§4.11)."""

from __future__ import annotations

import asyncio
import logging
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

if TYPE_CHECKING:
    from atroposlib.envs.base import BaseEnv

logger = logging.getLogger(__name__)


def _progress(total: int | None) -> Progress:
    columns = [SpinnerColumn(), TextColumn("{task.description}")]
    if total is not None:
        columns += [BarColumn(), MofNCompleteColumn()]
    columns.append(TimeElapsedColumn())
    return Progress(*columns, console=Console(stderr=True), transient=False)


def _concurrency(env: BaseEnv) -> int:
    if env.config.max_num_workers > 0:
        return env.config.max_num_workers
    servers = len(getattr(env.server, "servers", []) or [1])
    return max(1, env.config.max_num_workers_per_node * servers)


async def _next_item(env: BaseEnv) -> Any:
    if env.backlog:
        return env.backlog.pop(0)
    return await env.get_next_item()


async def _collect(env: BaseEnv, item: Any) -> Any:
    try:
        result, backlog = await env.collect_trajectories(item)
    except asyncio.CancelledError:
        raise
    except Exception:
        logger.exception("collect_trajectories failed; trying the next item")
        return None
    env.backlog.extend(backlog or [])
    return result


async def run_process(env: BaseEnv) -> None:
    """Roll out ``n_groups_to_process`` groups concurrently and write them to jsonl (then html).

    Items run ``max_num_workers`` at a time (or ``max_num_workers_per_node`` per
    server). A group counts when ``collect_trajectories`` returned something; an
    empty result is retried with the next item, as in the original.
    """
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
    with _progress(target) as progress:
        bar = progress.add_task("groups", total=target)
        while True:
            while (
                not exhausted and len(in_flight) < limit and env.curr_step + len(in_flight) < target
            ):
                item = await _next_item(env)
                if item is None:
                    exhausted = True
                    break
                in_flight.add(asyncio.create_task(_collect(env, item)))
            if not in_flight:
                break
            done, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                result = task.result()
                if not result or env.curr_step >= target:
                    if not result:
                        logger.info("no group from that item; retrying with the next one")
                    continue
                result = await env.postprocess_histories(result)
                await env.handle_send_to_api(
                    result, None, do_send_to_api=False, abort_on_any_max_length_exceeded=False
                )
                await env.wandb_log()
                env.curr_step += 1
                progress.update(bar, completed=env.curr_step)
    if env.curr_step < target:
        logger.warning("get_next_item ran out after %d of %d groups", env.curr_step, target)
    await env.close_servers()
    await _finish_files(env)


async def _finish_files(env: BaseEnv) -> None:
    if env.jsonl_writer is None:
        logger.warning("no group was written")
        return
    env.jsonl_writer.close()
    path = env.jsonl_writer.path
    logger.info("%d groups written to %s", env.jsonl_writer.lines, path)
    from atroposlib.frontend.jsonl2html import generate_html

    html = generate_html(str(path))
    logger.info("html view written to %s", html)


async def run_evaluate(env: BaseEnv) -> None:
    """``setup()`` then ``evaluate()`` once, with a progress spinner."""
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
