"""``json_value_problem``: names the first value of parsed JSON that no UTF-8 or C JSON encoder
takes (a lone surrogate, an integer beyond 64 bits), and costs one encode for clean data."""

from __future__ import annotations

import json

from atroposlib.utils.http_security import json_value_problem


def test_clean_data_passes():
    assert json_value_problem({"a": [1, "é", {"b": None, "c": 1.5}], "d": 2**64 - 1}) is None
    assert json_value_problem(json.loads('"\\ud83d\\ude00"')) is None  # a valid pair


def test_lone_surrogates_are_named_by_path():
    data = json.loads('{"messages": [{"content": "ok"}, {"content": "a\\ud800"}]}')
    assert json_value_problem(data)[0] == "messages.1.content"
    assert json_value_problem(json.loads('"\\udfff"'))[0] == "body"
    key = json_value_problem(json.loads('{"x": {"\\ud800": 1}}'))
    assert key is not None and key[0].startswith("x.") and "key" in key[1]


def test_integers_beyond_64_bits_are_named_unless_ints_are_not_checked():
    data = {"logit_bias": {"7": 2**70}, "seed": -(2**63)}
    assert json_value_problem(data) == ("logit_bias.7", "is an integer outside the 64-bit range")
    assert json_value_problem(data, check_ints=False) is None
    assert json_value_problem([True, 2**64])[0] == "1"


def test_deep_nesting_does_not_recurse():
    deep: list = []
    node = deep
    for _ in range(20_000):
        node.append([])
        node = node[0]
    node.append("\ud800")
    path, _ = json_value_problem(deep)
    assert path.count(".") == 20_000
