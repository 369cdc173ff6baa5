"""Advantage utilities: normalisation, returns and their invariants."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from atroposlib.utils.advantages import (
    allclose_to_first,
    compute_discounted_returns,
    compute_group_advantages,
    compute_grpo_process_supervision_advantages,
    compute_stats,
)

REWARD = st.floats(min_value=-10, max_value=10, allow_nan=False, allow_infinity=False)
JAGGED = st.lists(st.lists(REWARD, min_size=1, max_size=6), min_size=1, max_size=5)


@settings(deadline=None)
@given(JAGGED)
def test_compute_stats_matches_numpy_over_the_flattened_values(data):
    flat = np.array([v for row in data for v in row])
    stats = compute_stats(data)
    assert math.isclose(stats["mean"], flat.mean(), abs_tol=1e-9)
    assert math.isclose(stats["var"], flat.var(), rel_tol=1e-7, abs_tol=1e-9)


def test_compute_stats_of_nothing_raises():
    with pytest.raises(ValueError):
        compute_stats([[], []])


@settings(max_examples=60, deadline=None)
@given(JAGGED)
def test_process_supervision_step_rewards_are_zero_mean_unit_std(rewards):
    flat = np.array([v for row in rewards for v in row])
    assume(flat.std() > 1e-3)
    advs = compute_grpo_process_supervision_advantages(rewards)
    steps = []
    for adv in advs:
        adv = np.asarray(adv)
        steps.extend(adv - np.append(adv[1:], 0.0))  # undo the reverse cumsum
    assert abs(np.mean(steps)) < 1e-6
    assert math.isclose(np.std(steps), 1.0, rel_tol=1e-6)
    assert [len(a) for a in advs] == [len(r) for r in rewards]


def test_process_supervision_reverse_cumsum_and_discounting_by_hand():
    rewards = [[1.0, 0.0], [0.0, 1.0]]  # mean 0.5, std 0.5 -> normalised [1,-1], [-1,1]
    plain = compute_grpo_process_supervision_advantages(rewards)
    assert np.allclose(plain[0], [0.0, -1.0]) and np.allclose(plain[1], [0.0, 1.0])
    disc = compute_grpo_process_supervision_advantages(rewards, gamma=0.5)
    assert np.allclose(disc[0], [1 - 0.5, -1.0]) and np.allclose(disc[1], [-1 + 0.5, 1.0])


def test_process_supervision_constant_rewards_raise():
    with pytest.raises(ValueError, match="std"):
        compute_grpo_process_supervision_advantages([[1.0, 1.0], [1.0]])


@settings(deadline=None)
@given(st.lists(REWARD, min_size=1, max_size=8), st.floats(min_value=0, max_value=1))
def test_discounted_returns_satisfy_the_bellman_recursion(rewards, gamma):
    returns = compute_discounted_returns(rewards, gamma)
    for t in range(len(rewards)):
        nxt = returns[t + 1] if t + 1 < len(rewards) else 0.0
        assert math.isclose(returns[t], rewards[t] + gamma * nxt, abs_tol=1e-9)


def test_torch_inputs_give_torch_outputs():
    torch = pytest.importorskip("torch")
    out = compute_discounted_returns(torch.tensor([1.0, 1.0]), 1.0)
    assert isinstance(out, torch.Tensor) and out.tolist() == [2.0, 1.0]
    advs = compute_grpo_process_supervision_advantages([torch.tensor([1.0, 0.0])])
    assert isinstance(advs[0], torch.Tensor)


def test_allclose_to_first():
    assert allclose_to_first([1.0, 1.0 + 1e-10, 1.0]) is True
    assert allclose_to_first([1.0, 2.0]) is False
    assert list(allclose_to_first([[1, 2], [1, 2], [1, 3]], return_vector=True)) == [
        True,
        True,
        False,
    ]


@settings(deadline=None)
@given(st.lists(REWARD, min_size=2, max_size=16))
def test_group_advantages_are_zero_mean(scores):
    advs = compute_group_advantages(scores)
    assert abs(sum(advs)) < 1e-6 * max(1.0, max(abs(a) for a in advs)) * len(advs)
    assert compute_group_advantages([3.0]) == [0.0]
