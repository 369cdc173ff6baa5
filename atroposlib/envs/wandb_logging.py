"""Metric assembly for W&B (docs/design.md, "Files and metrics"). ``wandb`` is imported only when logging is on."""

from __future__ import annotations

import datetime
import logging
import os
import random
import string
from typing import Any, Dict, Iterable, List, Mapping, Sequence

import numpy as np

logger = logging.getLogger(__name__)

UNPREFIXED = ("server/",)


def list_stats(prefix: str, values: Sequence[float]) -> Dict[str, float]:
    """``{prefix}_mean|_std|_max|_min`` of ``values``; empty when it has one entry or none."""
    if len(values) <= 1:
        return {}
    arr = np.asarray(values, dtype=float)
    return {
        f"{prefix}_mean": float(arr.mean()),
        f"{prefix}_std": float(arr.std()),
        f"{prefix}_max": float(arr.max()),
        f"{prefix}_min": float(arr.min()),
    }


def completion_length_metrics(lengths: Sequence[int], max_token_len: int) -> Dict[str, float]:
    """``train/completion_lengths`` and its std/max/min/p95 (fraction above 0.95 × max)."""
    if not lengths:
        return {}
    arr = np.asarray(lengths, dtype=float)
    out = {
        "train/completion_lengths": float(arr.mean()),
        "train/completion_lengths_std": float(arr.std()),
        "train/completion_lengths_max": float(arr.max()),
        "train/completion_lengths_min": float(arr.min()),
    }
    if max_token_len > 0:
        out["train/completion_lengths_p95"] = float((arr > 0.95 * max_token_len).mean())
    return out


def rejected_metrics(rejected: Mapping[str, int]) -> Dict[str, int]:
    """``train/items_rejected`` (total) and ``train/items_rejected/<reason>`` counts."""
    out: Dict[str, int] = {"train/items_rejected": int(sum(rejected.values()))}
    for reason, count in rejected.items():
        out[f"train/items_rejected/{reason}"] = int(count)
    return out


def prefix_keys(metrics: Mapping[str, Any], prepend: str | None) -> Dict[str, Any]:
    """Prefix every key with ``{prepend}_`` except the server metrics."""
    if not prepend:
        return dict(metrics)
    return {(k if k.startswith(UNPREFIXED) else f"{prepend}_{k}"): v for k, v in metrics.items()}


def run_name(base: str | None) -> str | None:
    """``{base}-{YYYY-MM-DD}-{6 random lowercase letters}``, or None without a base."""
    if not base:
        return None
    suffix = "".join(random.choices(string.ascii_lowercase, k=6))
    return f"{base}-{datetime.date.today().isoformat()}-{suffix}"


LOCAL_MODES = ("offline", "disabled", "dryrun")


def _logged_in(wandb: Any) -> bool:
    """True when W&B has an API key (environment, netrc or settings); never prompts."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return bool(wandb.login(prompt=False, verify=False))
    except Exception as err:  # noqa: BLE001 - any failure here means "not configured"
        logger.debug("wandb.login(prompt=False) failed: %s", err)
        return False


def init_run(
    project: str | None, group: str | None, name: str | None, config: Dict[str, Any]
) -> Any:
    """Start a W&B run; without a W&B login, log one warning and run offline instead.

    ``process`` and ``evaluate`` turn W&B on by default, as the original does, so a
    user who never ran ``wandb login`` must still get a run: it is kept under
    ``./wandb`` (``wandb sync`` uploads it later). ``WANDB_MODE`` is honoured, and a
    W&B that fails to start at all only costs the metrics, never the run.
    """
    import wandb

    kwargs: Dict[str, Any] = {}
    if os.environ.get("WANDB_MODE", "").lower() not in LOCAL_MODES and not _logged_in(wandb):
        logger.warning(
            "W&B is not configured (no API key: run `wandb login` or set WANDB_API_KEY); "
            "logging offline under ./wandb instead (--env.use_wandb false turns W&B off)"
        )
        kwargs["mode"] = "offline"
    try:
        return wandb.init(project=project, group=group, name=name, config=config, **kwargs)
    except Exception as err:  # noqa: BLE001 - W&B must not end the run
        if kwargs:
            logger.warning("W&B could not start offline (%s); continuing without W&B", err)
            return None
        logger.warning("W&B could not start (%s); logging offline under ./wandb instead", err)
    try:
        return wandb.init(project=project, group=group, name=name, config=config, mode="offline")
    except Exception as err:  # noqa: BLE001 - W&B must not end the run
        logger.warning("W&B could not start offline either (%s); continuing without W&B", err)
        return None


def log(metrics: Dict[str, Any], step: int) -> None:
    """``wandb.log(metrics, step=step)`` when a run is active."""
    import wandb

    if wandb.run is not None:
        wandb.log(metrics, step=step)


def rollout_table(rollouts: Iterable[List[tuple]]) -> Any:
    """A ``wandb.Table`` with columns ``text`` and ``score``."""
    import wandb

    table = wandb.Table(columns=["text", "score"])
    for group in rollouts:
        for text, score in group:
            table.add_data(text, score)
    return table
