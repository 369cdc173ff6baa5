"""Summary statistics for metric dictionaries."""

from __future__ import annotations

from typing import Any, Dict, Sequence

import numpy as np


def get_std_min_max_avg(
    name: str, data: Sequence[float], metrics_dict: Dict[str, Any]
) -> Dict[str, Any]:
    """Add ``{name}_mean``, ``_std``, ``_max`` and ``_min`` of ``data`` to ``metrics_dict``.

    ``metrics_dict`` is updated in place and returned. Empty ``data`` adds nothing (a
    statistic of nothing is not zero).

    Example::

        get_std_min_max_avg("train_perf/task_duration", [1.0, 3.0], {})
        # {"train_perf/task_duration_mean": 2.0, "..._std": 1.0, "..._max": 3.0, "..._min": 1.0}
    """
    if len(data) == 0:
        return metrics_dict
    arr = np.asarray(data, dtype=float)
    metrics_dict[f"{name}_mean"] = float(arr.mean())
    metrics_dict[f"{name}_std"] = float(arr.std())
    metrics_dict[f"{name}_max"] = float(arr.max())
    metrics_dict[f"{name}_min"] = float(arr.min())
    return metrics_dict


__all__ = ["get_std_min_max_avg"]
