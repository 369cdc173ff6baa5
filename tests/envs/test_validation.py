"""The ScoredData rules of ``normalize_group`` and the plain-JSON check it relies on."""

from __future__ import annotations

import json

import pytest

from atroposlib.envs.validation import InvalidGroupError, is_plain_json, normalize_group


@pytest.mark.parametrize(
    "value",
    [
        None,
        1,
        2**80,
        "é",
        True,
        0.5,
        [[1, 2], [3, -100]],
        [0.5, -1.5],
        [1, [2, {"a": None}]],
        {"t": {"u": [1.5, "x"]}},
    ],
)
def test_plain_json_accepts_data_json_dumps_encodes_strictly(value):
    assert is_plain_json(value)
    json.dumps(value, allow_nan=False)


@pytest.mark.parametrize(
    "value",
    [
        float("nan"),
        [1, float("inf")],
        [[1, 2], [3, float("nan")]],
        [0.5, float("nan")],
        [[1], [(2,)]],
        {"a": {"b": [float("-inf")]}},
        {1: "int key"},
        (1, 2),
        {"a": {1, 2}},
        type("Sub", (int,), {})(3),
    ],
)
def test_plain_json_refuses_what_needs_a_closer_look(value):
    assert not is_plain_json(value)


def test_plain_json_refuses_deep_and_circular_values_without_recursing_forever():
    deep: list = []
    for _ in range(200):
        deep = [deep]
    assert not is_plain_json(deep)
    loop: list = []
    loop.append(loop)
    assert not is_plain_json(loop)


def test_group_field_that_is_not_strict_json_is_refused_by_name():
    group = {
        "tokens": [[1, 2]],
        "masks": [[-100, 2]],
        "scores": [1.0],
        "extra": {"x": float("nan")},
    }
    with pytest.raises(InvalidGroupError, match="extra"):
        normalize_group(group)
    group["extra"] = {1: (2, 3)}  # json.dumps writes it: kept as it is
    assert normalize_group(group)["extra"] == {1: (2, 3)}


def test_sequence_errors_name_field_index_and_position():
    with pytest.raises(InvalidGroupError, match=r"tokens\[1\]\[0\]"):
        normalize_group({"tokens": [[1], ["a"]], "masks": [[1], [1]], "scores": [0.0, 1.0]})
    with pytest.raises(InvalidGroupError, match=r"scores\[1\]"):
        normalize_group({"tokens": [[1], [2]], "masks": [[1], [1]], "scores": [0.0, "x"]})
    with pytest.raises(InvalidGroupError, match=r"masks\[0\]"):
        normalize_group({"tokens": [(1, 2)], "masks": [[1]], "scores": [0.0]})
