"""metrics, display, best-of-n selection, length penalties and type definitions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from atroposlib.utils.best_of_n_selection import select_best_index
from atroposlib.utils.display import display_metrics_table
from atroposlib.utils.metrics import get_std_min_max_avg
from helpers.length_penalties import (
    ThresholdLengthPenaltyCalculator,
    ThresholdLengthPenaltyConfig,
    length_penalty_factor,
)


@settings(deadline=None)
@given(st.lists(st.floats(min_value=-1e6, max_value=1e6), min_size=1, max_size=30))
def test_std_min_max_avg_matches_numpy(data):
    out = get_std_min_max_avg("train_perf/x", data, {"keep": 1})
    assert out["keep"] == 1
    assert out["train_perf/x_mean"] == pytest.approx(np.mean(data), abs=1e-6)
    assert out["train_perf/x_std"] == pytest.approx(np.std(data), abs=1e-6)
    assert out["train_perf/x_max"] == max(data) and out["train_perf/x_min"] == min(data)


def test_std_min_max_avg_of_nothing_adds_nothing():
    assert get_std_min_max_avg("x", [], {}) == {}


def test_display_metrics_table_renders_every_metric(capsys):
    text = display_metrics_table("gsm8k_eval", {"eval/percent_correct": 0.25, "n": 4}, 0.0, 2.0)
    assert "eval/percent_correct" in text and "0.2500" in text and "gsm8k_eval" in text


def test_best_of_n_prefers_primary_then_lower_secondary_then_first():
    assert select_best_index([1.0, 1.0, 0.0], [30, 12, 5]) == 1
    assert select_best_index([0.0, 2.0], [1, 100]) == 1
    assert select_best_index([1.0, 1.0], [5, 5]) == 0
    assert select_best_index([1.0, 0.0], [5, 5], primary_higher_is_better=False) == 1
    assert select_best_index([1.0, 1.0], [5, 9], secondary_lower_is_better=False) == 1


@settings(deadline=None)
@given(st.lists(st.tuples(st.integers(-3, 3), st.integers(0, 9)), min_size=1, max_size=10))
def test_best_of_n_picks_a_maximal_primary(pairs):
    primary, secondary = [p for p, _ in pairs], [s for _, s in pairs]
    best = select_best_index(primary, secondary)
    assert primary[best] == max(primary)
    assert secondary[best] == min(s for p, s in pairs if p == max(primary))


@pytest.mark.parametrize("p, s", [([], []), ([1.0], [1, 2])])
def test_best_of_n_bad_input_raises(p, s):
    with pytest.raises(ValueError):
        select_best_index(p, s)


def test_length_penalty_by_hand():
    calc = ThresholdLengthPenaltyCalculator(ThresholdLengthPenaltyConfig(max_token_length=100))
    assert calc.apply_length_penalties([1.0, 1.0, 1.0], [40, 75, 300]) == [1.0, 0.5, 0.0]
    assert calc.apply_length_penalties([1.0, -1.0], [90, 90]) == [1.0, -1.0]  # not all correct
    with pytest.raises(ValueError):
        calc.apply_length_penalties([1.0], [1, 2])
    with pytest.raises(ValidationError):
        ThresholdLengthPenaltyConfig(threshold_ratio=1.5)


@settings(deadline=None)
@given(st.integers(1, 4096), st.integers(0, 5000), st.integers(0, 5000))
def test_length_penalty_is_in_unit_interval_and_non_increasing(max_len, a, b):
    fa, fb = length_penalty_factor(a, max_len), length_penalty_factor(b, max_len)
    assert 0.0 <= fa <= 1.0
    if a <= b:
        assert fa >= fb


def test_message_typed_dict_takes_role_and_content():
    from atroposlib import type_definitions as td  # names themselves: tests/test_public_names.py

    msg: td.Message = {"role": "user", "content": "hi"}
    assert msg["role"] == "user"
