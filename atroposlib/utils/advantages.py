"""Advantage helpers for GRPO-style training, including process supervision.

Pure functions over numbers. They accept lists, numpy arrays or torch tensors; results
are torch tensors when the input is a torch tensor (torch is optional for
environments), numpy arrays otherwise.

Example::

    advs = compute_grpo_process_supervision_advantages([[1.0, 0.0], [0.0]])
    # normalised by the global mean/std, then reverse-cumsummed per trajectory
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence, Union

import numpy as np

Number = Union[int, float]


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _to_numpy(x: Any) -> np.ndarray:
    if _is_torch(x):
        return x.detach().cpu().numpy()
    return np.asarray(x, dtype=float)


def _like(result: np.ndarray, template: Any) -> Any:
    """Return ``result`` as a torch tensor if ``template`` is one."""
    if _is_torch(template):
        import torch

        return torch.as_tensor(
            result, dtype=template.dtype if template.is_floating_point() else torch.float32
        )
    return result


def allclose_to_first(
    values: Any,
    rtol: float = 1e-05,
    atol: float = 1e-08,
    equal_nan: bool = False,
    return_vector: bool = False,
) -> Union[bool, Any]:
    """Whether every entry (row, for >1-D input) is close to the first one.

    With ``return_vector`` the per-entry booleans are returned instead of their ``all``.
    """
    arr = _to_numpy(values)
    if arr.size == 0 or arr.ndim == 0:
        return np.ones(arr.shape[:1] or (1,), dtype=bool) if return_vector else True
    close = np.isclose(arr, arr[0], rtol=rtol, atol=atol, equal_nan=equal_nan)
    if close.ndim > 1:
        close = close.reshape(close.shape[0], -1).all(axis=1)
    if return_vector:
        return _like(close, values) if _is_torch(values) else close
    return bool(close.all())


def _flatten(data: Any) -> List[float]:
    if _is_torch(data) or isinstance(data, np.ndarray):
        return [float(v) for v in _to_numpy(data).ravel()]
    if isinstance(data, (int, float, np.number)):
        return [float(data)]
    out: List[float] = []
    for entry in data:
        out.extend(_flatten(entry))
    return out


def compute_stats(data: Sequence[Any]) -> Dict[str, float]:
    """Mean and (population) variance over all numbers of a jagged nested list.

    Raises:
        ValueError: when ``data`` holds no numbers.
    """
    flat = _flatten(data)
    if not flat:
        raise ValueError("compute_stats: no values")
    mean = math.fsum(flat) / len(flat)
    var = math.fsum((v - mean) ** 2 for v in flat) / len(flat)
    return {"mean": mean, "var": var}


def compute_discounted_returns(rewards: Any, gamma: float) -> Any:
    """``G_t = r_t + gamma * G_{t+1}`` for a 1-D reward sequence."""
    arr = _to_numpy(rewards).astype(float).ravel()
    out = np.zeros_like(arr)
    running = 0.0
    for t in range(len(arr) - 1, -1, -1):
        running = arr[t] + gamma * running
        out[t] = running
    return _like(out, rewards)


def compute_grpo_process_supervision_advantages(
    rewards: Sequence[Sequence[Number]],
    gamma: float | None = None,
    std_tol: float = 1e-8,
) -> List[Any]:
    """Per-step advantages for process supervision.

    Rewards are normalised by the mean/std over *all* steps of all trajectories, then
    each trajectory is reverse-cumsummed (the sum of the normalised rewards from each
    step on), or discounted with ``gamma`` when given.

    Raises:
        ValueError: when the global std is below ``std_tol`` (no signal to learn from).
    """
    stats = compute_stats(rewards)
    std = math.sqrt(stats["var"])
    if std < std_tol:
        raise ValueError(f"reward std {std} is below std_tol={std_tol}; advantages are undefined")
    advantages = []
    for trajectory in rewards:
        normalised = (_to_numpy(trajectory).astype(float).ravel() - stats["mean"]) / std
        if gamma is None:
            adv = np.cumsum(normalised[::-1])[::-1].copy()
        else:
            adv = compute_discounted_returns(normalised, gamma)
        advantages.append(_like(adv, trajectory))
    return advantages


def compute_group_advantages(scores: Sequence[Number], std_eps: float = 1e-8) -> List[float]:
    """GRPO group advantages ``(s - mean) / max(std, eps)``; zeros for a group of one."""
    values = [float(s) for s in scores]
    if len(values) <= 1:
        return [0.0] * len(values)
    mean = math.fsum(values) / len(values)
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))
    return [(v - mean) / max(std, std_eps) for v in values]


__all__ = [
    "allclose_to_first",
    "compute_discounted_returns",
    "compute_group_advantages",
    "compute_grpo_process_supervision_advantages",
    "compute_stats",
]
