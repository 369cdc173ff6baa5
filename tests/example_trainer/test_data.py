"""Unit tests of batch → tensor preparation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from example_trainer.data import (
    IGNORE_INDEX,
    group_advantages,
    group_to_samples,
    pad_data_to_good_offset,
    sequence_temperature,
)


def _group(n=2, length=6, scores=None, **extra):
    tokens = [[10 + i + j for j in range(length)] for i in range(n)]
    masks = [[IGNORE_INDEX] * 3 + t[3:] for t in tokens]
    return {
        "tokens": tokens,
        "masks": masks,
        "scores": scores or [float(i) for i in range(n)],
        **extra,
    }


def test_inputs_drop_last_token_and_labels_are_masks_shifted_by_one():
    g = _group(n=1, scores=[1.0])
    mb = pad_data_to_good_offset([g], batch_size=4, pad_to_multiple=8)[0]
    assert mb.input_ids.shape == (1, 8)
    assert mb.input_ids[0, :5].tolist() == g["tokens"][0][:-1]
    assert mb.labels[0, :5].tolist() == g["masks"][0][1:]
    assert mb.labels[0, 5:].tolist() == [IGNORE_INDEX] * 3
    assert mb.attention_mask[0].tolist() == [1] * 5 + [0] * 3


def test_advantages_are_normalised_per_group():
    # Sample std (ddof=1) plus 1e-4, as TRL: std of [1, -1, 1, -1] is sqrt(4/3).
    a = group_advantages([1.0, -1.0, 1.0, -1.0])
    assert a == pytest.approx([x / (np.sqrt(4 / 3) + 1e-4) for x in [1.0, -1.0, 1.0, -1.0]])
    b = group_advantages([0.0, 0.0, 3.0])
    assert np.mean(b) == pytest.approx(0.0, abs=1e-9)
    assert np.std(b, ddof=1) == pytest.approx(1.0, rel=1e-3)
    assert group_advantages([5.0, 5.0]) == [0.0, 0.0]
    assert group_advantages([0.7]) == [0.7]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-10, 10, allow_nan=False), min_size=2, max_size=16))
def test_group_advantages_have_zero_mean(scores):
    assert abs(np.mean(group_advantages(scores))) < 1e-6


def test_set_advantage_to_zero_override():
    g = _group(n=2, scores=[1.0, 0.0], overrides=[{"set_advantage_to_zero": True}, {}])
    s = group_to_samples(g)
    assert s[0].advantages == [0.0] * 5
    assert s[1].advantages == pytest.approx([-0.5 / (np.sqrt(0.5) + 1e-4)] * 5)


def test_env_supplied_token_advantages_win_and_are_shifted():
    adv = [[0.0, 0.1, 0.2, 0.3, 0.4, 0.5], [1.0, 1.1, 1.2, 1.3, 1.4, 1.5]]
    s = group_to_samples(_group(n=2, advantages=adv))
    assert s[0].advantages == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    assert s[1].advantages == pytest.approx([1.1, 1.2, 1.3, 1.4, 1.5])


def test_temperature_priority():
    over = [{"temperature": 0.3}, {}]
    assert sequence_temperature(0, over, {"temperature": 0.5}, {"temperature": 0.7}) == 0.3
    assert sequence_temperature(1, over, {"temperature": 0.5}, {"temperature": 0.7}) == 0.5
    assert sequence_temperature(1, over, None, {"temperature": 0.7}) == 0.7
    assert sequence_temperature(1, None, None, None) == 1.0


def test_inference_logprobs_aligned_to_labels_and_padded_with_one():
    lp = [[1.0, 1.0, 1.0, -0.3, -0.4, -0.5]]
    mb = pad_data_to_good_offset(
        [_group(n=1, scores=[1.0], inference_logprobs=lp)], 4, pad_to_multiple=8
    )[0]
    assert mb.inference_logprobs[0].tolist() == pytest.approx(
        [1.0, 1.0, -0.3, -0.4, -0.5, 1.0, 1.0, 1.0]
    )


def test_missing_inference_logprobs_gives_none():
    mb = pad_data_to_good_offset([_group()], 4)[0]
    assert mb.inference_logprobs is None


def test_remainder_is_kept_as_smaller_micro_batch():
    mbs = pad_data_to_good_offset([_group(n=3, scores=[0, 1, 2])], batch_size=2, pad_to_multiple=1)
    assert [mb.input_ids.shape[0] for mb in mbs] == [2, 1]


def test_mismatched_group_lengths_raise_clear_error():
    g = _group(n=2)
    g["scores"] = [1.0]
    with pytest.raises(ValueError, match="scores"):
        group_to_samples(g)
    g = _group(n=1, scores=[1.0])
    g["masks"][0] = g["masks"][0][:-1]
    with pytest.raises(ValueError, match="mask"):
        group_to_samples(g)


def test_padding_uses_pad_token_and_max_len_truncates():
    mb = pad_data_to_good_offset(
        [_group(n=1, length=10, scores=[1.0])], 1, pad_token_id=7, pad_to_multiple=64, max_len=12
    )[0]
    assert mb.input_ids.shape == (1, 12)
    assert mb.input_ids[0, 9:].tolist() == [7, 7, 7]
