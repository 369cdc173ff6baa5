"""rlaif: verdict parsing, pairing, preference scores and a judged group."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from environments.rlaif_server import (
    RLAIFConfig,
    RLAIFEnv,
    comparison_pairs,
    parse_rating,
    parse_verdict,
    preference_scores,
    prompt_from_row,
)


@pytest.mark.parametrize(
    "text, verdict",
    [
        ("A is clearer. [[A]]", "A"),
        ("[[a]] no wait [[B]]", "B"),
        ("[[tie]]", "tie"),
        ("[[ TIE ]]", "tie"),
        ("B", "B"),
        ("Both are fine", None),
        ("", None),
        ("[[C]]", None),
    ],
)
def test_parse_verdict(text, verdict):
    assert parse_verdict(text) == verdict


@pytest.mark.parametrize(
    "text, rating", [("Good. Rating: 8", 8), ("rating:10", 10), ("Rating: 0", None), ("", None)]
)
def test_parse_rating(text, rating):
    assert parse_rating(text) == rating


def test_comparison_pairs():
    assert comparison_pairs(1) == [] and comparison_pairs(2) == [(0, 1)]
    assert comparison_pairs(3) == [(0, 1), (1, 2), (2, 0)]


def test_preference_scores_by_hand():
    assert preference_scores(2, [(0, 1, 0)]) == [1.0, -1.0]
    assert preference_scores(2, [(0, 1, None)]) == [0.0, 0.0]
    assert preference_scores(3, [(0, 1, 0), (1, 2, 2), (2, 0, 0)]) == [1.0, -1.0, 0.0]


@settings(deadline=None)
@given(
    st.integers(2, 8).flatmap(
        lambda n: st.tuples(
            st.just(n), st.lists(st.sampled_from([0, 1, None]), min_size=n, max_size=n)
        )
    )
)
def test_preference_scores_are_bounded_and_sum_to_zero(case):
    n, picks = case
    outcomes = [
        (i, j, None if p is None else (i, j)[p])
        for (i, j), p in zip(comparison_pairs(n), picks, strict=False)
    ]
    scores = preference_scores(n, outcomes)
    assert all(-1.0 <= s <= 1.0 for s in scores)
    if n > 2:  # every answer takes part in exactly two comparisons
        assert sum(scores) == pytest.approx(0.0)


def test_prompt_from_row():
    assert prompt_from_row({"prompt": "hi"}) == "hi"
    assert prompt_from_row({"conversation": [{"role": "user", "content": "yo"}]}) == "yo"
    assert prompt_from_row({"prompt": "  "}) is None and prompt_from_row({"x": 1}) is None


class _LongerIsBetterJudge:
    """Prefers the longer response; answers with a verdict in the MT-Bench style."""

    def __init__(self):
        self.calls = 0

    async def chat_completion(self, messages, **kwargs):
        self.calls += 1
        text = messages[0]["content"]
        a = text.split("[Response A]\n")[1].split("\n\n[Response B]")[0]
        b = text.split("[Response B]\n")[1].split("\n\nThink briefly")[0]
        verdict = "[[A]]" if len(a) > len(b) else "[[B]]" if len(b) > len(a) else "garbled"
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content=verdict))])


async def test_judge_group_turns_preferences_into_scores():
    server = APIServerConfig(
        base_url="http://127.0.0.1:9/v1", model_name="m", server_type="vllm", health_check=False
    )
    env = RLAIFEnv(RLAIFConfig(tokenizer_name="unused"), server)
    env.judge = _LongerIsBetterJudge()
    scores = await env.judge_group("p", ["a", "aaa", "aa"])
    assert scores == [-1.0, 1.0, 0.0]
    assert await env.judge_group("p", ["<think>long reasoning</think>x", "y"]) == [
        0.0,
        0.0,
    ]  # thinking stripped
    assert env.unparsed_verdicts == 1
