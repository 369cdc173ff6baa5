"""Two small pieces every environment needs: run an eval set, and log what it measured.

Every environment's evaluation needs the same thirty lines (a semaphore, a try/except
per item, the mean of the scores, ``evaluate_log``) and the same ``wandb_log`` block (the
training buffer's mean, the last eval's metrics). Environments call these, and each
environment file says in a few lines what it evaluates and logs.

Example::

    async def evaluate(self, *args, **kwargs):
        async def one(item):
            text = await ...                      # one request for one eval item
            return {"messages": ..., "score": s, "correct": s > 0}

        self.eval_metrics = await run_eval_set(self, self.test, one)  # eval/percent_correct

    async def wandb_log(self, wandb_metrics=None):
        metrics = drain_metrics(wandb_metrics, self.eval_metrics,
                                train={"train/percent_correct": self.percent_correct_buffer})
        await super().wandb_log(metrics)
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, Dict, Iterable, List, Mapping, MutableMapping

logger = logging.getLogger(__name__)

Sample = Dict[str, Any]

__all__ = ["drain_metrics", "mean_of", "means_by", "run_eval_set"]


def mean_of(samples: Iterable[Mapping[str, Any]], key: str) -> float:
    """Mean of ``sample[key]`` over the samples that have a value (booleans count 0/1); 0.0 if none."""
    values = [float(s[key]) for s in samples if s.get(key) is not None]
    return sum(values) / len(values) if values else 0.0


def means_by(
    samples: Iterable[Mapping[str, Any]],
    key: str,
    fields: Mapping[str, str],
    order: Iterable[Any] | None = None,
    prefix: str = "eval",
) -> Dict[str, float]:
    """Per-group means: ``{prefix}/{group}/{name}`` is :func:`mean_of` ``field`` over the
    samples whose ``sample[key]`` is ``group``, for each ``name: field`` of ``fields``.

    Groups come in the order of ``order`` (a group with no sample is left out), else
    sorted. E.g. ``means_by(samples, "task", {"accuracy": "correct"})`` gives
    ``{"eval/<task>/accuracy": ...}`` for each task evaluated.
    """
    by_group: Dict[Any, List[Mapping[str, Any]]] = {}
    for sample in samples:
        by_group.setdefault(sample[key], []).append(sample)
    metrics: Dict[str, float] = {}
    for group in sorted(by_group) if order is None else order:
        rows = by_group.get(group)
        if rows:
            for name, field in fields.items():
                metrics[f"{prefix}/{group}/{name}"] = mean_of(rows, field)
    return metrics


async def run_eval_set(
    env: Any,
    items: Iterable[Any],
    run_one: Callable[[Any], Awaitable[Sample | None]],
    *,
    metric: str = "eval/percent_correct",
    value: str = "correct",
    failed_metric: str = "eval/failed_requests",
    extra_metrics: Callable[[List[Sample]], Mapping[str, float]] | None = None,
    generation_parameters: Mapping[str, Any] | None = None,
    task_name: str | None = None,
    concurrency: int | None = None,
) -> Dict[str, float]:
    """Run ``run_one`` on every item, write the results with ``env.evaluate_log``, return the metrics.

    At most ``concurrency`` (default ``env.config.max_eval_workers``) items run at once. ``run_one`` returns the
    sample to save (``messages``, ``score`` ...) or None; an exception in one item is
    logged and counted in ``failed_metric`` instead of voiding the whole evaluation.
    ``metric`` is the mean of ``sample[value]`` (``eval/percent_correct`` of ``correct`` by
    default); ``extra_metrics(samples)`` adds more.
    """
    start = time.time()
    limit = concurrency if concurrency is not None else env.config.max_eval_workers
    sem = asyncio.Semaphore(max(1, int(limit)))
    name = getattr(env, "name", None) or type(env).__name__

    async def guarded(item: Any) -> Sample | None:
        async with sem:
            try:
                return await run_one(item)
            except Exception:  # one failed request must not void the eval; counted below
                logger.exception("%s: evaluation of one item failed", name)
                return None

    results = await asyncio.gather(*(guarded(item) for item in items))
    samples = [r for r in results if r is not None]
    metrics: Dict[str, float] = {metric: mean_of(samples, value)}
    if extra_metrics is not None:
        metrics.update(extra_metrics(samples))
    metrics[failed_metric] = float(len(results) - len(samples))
    await env.evaluate_log(
        metrics=dict(metrics),
        task_name=task_name,
        samples=samples,
        start_time=start,
        end_time=time.time(),
        generation_parameters=dict(generation_parameters or {}),
    )
    return metrics


def drain_metrics(
    wandb_metrics: Mapping[str, Any] | None,
    eval_metrics: MutableMapping[str, Any] | None = None,
    train: Mapping[str, List[float]] | None = None,
) -> Dict[str, Any]:
    """The metrics for one ``wandb_log`` call; empties what it reports.

    ``train`` maps a metric name to a buffer of per-rollout values collected since the
    last call (e.g. ``{"train/percent_correct": self.percent_correct_buffer}``): each
    non-empty buffer is logged as its mean, then cleared in place. ``eval_metrics`` (the
    last evaluation's result) is added once, then cleared in place.
    """
    metrics: Dict[str, Any] = dict(wandb_metrics or {})
    for key, buffer in (train or {}).items():
        if buffer:
            metrics[key] = sum(buffer) / len(buffer)
            buffer.clear()
    if eval_metrics:
        metrics.update(eval_metrics)
        eval_metrics.clear()
    return metrics
