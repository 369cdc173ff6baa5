"""SFT selection and DPO pairing rules (docs/design.md, "Export tools") and the TRL record formats."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from atroposlib.frontend.export import (
    Deduper,
    GroupView,
    dpo_records,
    pair_dpo,
    select_sft,
    sft_records,
    split_conversation_pair,
)
from atroposlib.frontend.rollouts import longest_common_prefix, split_prefix


def test_sft_sorts_by_score_and_drops_non_positive_scores() -> None:
    assert select_sft([0.2, 1.0, 0.0, -1.0, 0.5], top_n=10, allow_negative=False, min_diff=0.0) == [
        1,
        4,
        0,
    ]


def test_sft_allow_negative_keeps_everything_in_score_order() -> None:
    assert select_sft([0.0, -1.0, 0.5], top_n=10, allow_negative=True, min_diff=0.0) == [2, 0, 1]


def test_sft_min_diff_keeps_only_scores_clearly_above_the_group_minimum() -> None:
    # min is -1.0; 0.0 - (-1.0) = 1.0 is not > 1.0, 0.5 + 1 = 1.5 is
    assert select_sft([0.0, -1.0, 0.5, 1.0], top_n=10, allow_negative=True, min_diff=1.0) == [3, 2]


def test_sft_top_n_caps_the_number_kept() -> None:
    assert select_sft([3.0, 2.0, 1.0, 4.0], top_n=2, allow_negative=False, min_diff=0.0) == [3, 0]
    assert select_sft([1.0], top_n=0, allow_negative=False, min_diff=0.0) == []


def test_dpo_pairs_best_positive_with_a_negative_below_the_margin() -> None:
    pairs = pair_dpo(
        [1.0, -1.0], n_pairs=3, allow_negative=False, min_diff=0.5, rng=random.Random(0)
    )
    assert pairs == [(0, 1)]


def test_dpo_negative_is_used_once_and_drawn_from_the_lowest_n_pairs() -> None:
    scores = [1.0, 0.9, 0.8, -1.0, -0.9, 0.1]
    pairs = pair_dpo(scores, n_pairs=2, allow_negative=False, min_diff=0.5, rng=random.Random(1))
    # pool = the 2 lowest (indices 3 and 4); positives are the top 2 (0 and 1)
    assert [p for p, _ in pairs] == [0, 1]
    assert sorted(n for _, n in pairs) == [3, 4]


def test_dpo_positive_without_a_far_enough_negative_gets_no_pair() -> None:
    assert (
        pair_dpo([1.0, 0.8], n_pairs=3, allow_negative=False, min_diff=0.5, rng=random.Random(0))
        == []
    )
    assert (
        pair_dpo([-0.2, -1.0], n_pairs=3, allow_negative=False, min_diff=0.5, rng=random.Random(0))
        == []
    )
    assert pair_dpo(
        [-0.2, -1.0], n_pairs=3, allow_negative=True, min_diff=0.5, rng=random.Random(0)
    ) == [(0, 1)]


@given(
    st.lists(st.floats(-5, 5, allow_nan=False), max_size=12),
    st.integers(0, 6),
    st.floats(0, 2, allow_nan=False),
    st.booleans(),
    st.integers(0, 99),
)
def test_dpo_pairs_respect_margin_and_never_reuse_a_negative(
    scores, n_pairs, min_diff, allow_neg, seed
) -> None:
    pairs = pair_dpo(scores, n_pairs, allow_neg, min_diff, random.Random(seed))
    negatives = [n for _, n in pairs]
    assert len(negatives) == len(set(negatives))
    assert len(pairs) <= n_pairs
    for pos, neg in pairs:
        assert scores[neg] < scores[pos] - min_diff
        assert allow_neg or scores[pos] > 0


@given(st.lists(st.text(max_size=8), min_size=2, max_size=6))
def test_split_prefix_reassembles_every_text(texts) -> None:
    prefix, rest = split_prefix(texts)
    assert [prefix + r for r in rest] == texts
    assert prefix == longest_common_prefix(texts)
    assert all(t.startswith(prefix) for t in texts)


def test_conversation_pair_prompt_is_the_shared_leading_turns() -> None:
    sys_user = [{"role": "system", "content": "s"}, {"role": "user", "content": "q", "reward": 1}]
    good = sys_user + [{"role": "assistant", "content": "right"}]
    bad = sys_user + [{"role": "assistant", "content": "wrong"}]
    prompt, chosen, rejected = split_conversation_pair(good, bad)
    assert prompt == [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    assert chosen == [{"role": "assistant", "content": "right"}]
    assert rejected == [{"role": "assistant", "content": "wrong"}]
    assert split_conversation_pair(good, good) is None


def test_trl_records_have_exactly_trl_columns() -> None:
    view = GroupView(
        [1.0, -1.0],
        "P:",
        ["good", "bad"],
        [
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "good"}],
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "bad"}],
        ],
    )
    assert sft_records(view, [0], False, "trl") == [{"prompt": "P:", "completion": "good"}]
    assert set(sft_records(view, [0], True, "trl")[0]) == {"messages"}
    assert dpo_records(view, [(0, 1)], False, "trl") == [
        {"prompt": "P:", "chosen": "good", "rejected": "bad"}
    ]
    assert set(dpo_records(view, [(0, 1)], True, "trl")[0]) == {"prompt", "chosen", "rejected"}
    assert sft_records(view, [0], False, "atropos") == [
        {"prefix": "P:", "completion": "good", "score": 1.0}
    ]
    assert dpo_records(view, [(0, 1)], False, "atropos") == [
        {"prefix": "P:", "pos": "good", "score": 1.0, "neg": "bad"}
    ]
    assert set(dpo_records(view, [(0, 1)], True, "atropos")[0]) == {"pos", "score", "neg"}


def test_deduper_ignores_score_and_remembers_lines_of_an_existing_file(tmp_path) -> None:
    d = Deduper()
    assert d.is_new({"prefix": "a", "completion": "b", "score": 1.0})
    assert not d.is_new({"prefix": "a", "completion": "b", "score": 0.5})
    path = tmp_path / "prev.jsonl"
    path.write_text('{"prompt": "x", "completion": "y"}\n\n')
    d2 = Deduper()
    assert d2.load(path) == 1
    assert not d2.is_new({"prompt": "x", "completion": "y"})
