"""Each built-in reward on hand-written cases: right, wrong, malformed and empty output."""

from __future__ import annotations

import math

import pytest

from atroposlib.envs.reward_fns import registry
from atroposlib.envs.reward_fns.chandas_meter_reward import devanagari_to_iast, meter_score, scan
from atroposlib.envs.reward_fns.crossword_format_reward import parse_crossword_answers

RIGHT = "<think>6 times 12 is 72</think>The answer is \\boxed{72}."
WRONG = "<think>guess</think>The answer is \\boxed{71}."
MALFORMED = "The answer is 72 but I did not box it </think></think>"
EMPTY = ""


def test_accuracy():
    reward = registry.create("accuracy")
    assert reward([RIGHT, WRONG, MALFORMED, EMPTY], solution="72") == [1.0, 0.0, 0.0, 0.0]
    assert reward(["\\boxed{1,000}"], answer=["1000"]) == [1.0]
    assert reward(["\\boxed{\\frac{1}{2}}"], solution="0.5") == [1.0]
    assert reward([RIGHT], solution="\\boxed{72}") == [1.0]
    assert reward([RIGHT], solution="") == [0.0]  # unparseable gold
    assert reward([RIGHT, RIGHT]) == [0.0, 0.0]  # no gold: error path, scored 0
    assert reward([RIGHT], solution=["72", "73"]) == [0.0]  # misaligned golds


def test_format():
    reward = registry.create("format", require_all_tags=True)
    good = "<think>reasoning</think><answer>72</answer>"
    assert reward([good, "<think>r</think> 72", "<think></think><answer>1</answer>", EMPTY]) == [
        1.0,
        0.0,
        0.0,
        0.0,
    ]
    assert reward(["<think>a</think><think>b</think><answer>1</answer>"]) == [0.0]
    loose = registry.create(
        {"type": "format", "require_all_tags": False, "preferred_tags": ["think"]}
    )
    assert loose(["<THINK>x</THINK>", "nothing"]) == [1.0, 0.0]


def test_r1():
    reward = registry.create("r1", format_weight=1.0)
    right = "<think>6*12</think><answer>\\boxed{72}</answer>"
    wrong = "<think>6*12</think><answer>\\boxed{70}</answer>"
    unformatted_right = "the answer is \\boxed{72}"
    assert reward([right, wrong, unformatted_right, EMPTY], solution="72") == [2.0, 1.0, 1.0, 0.0]


def test_cascading_r1_math():
    reward = registry.create("cascading_r1_math")
    no_answer = "<think>hmm</think>I am not sure."
    assert reward([RIGHT, WRONG, no_answer, MALFORMED, EMPTY], solution="72") == [
        1.0,
        0.2,
        0.1,
        0.0,
        0.0,
    ]


def test_reasoning_steps():
    reward = registry.create("reasoning_steps")
    steps = "Step 1: read.\nStep 2: multiply.\nStep 3: answer 72."
    assert reward([steps, "First, read. Then, add.", "72", EMPTY]) == [
        1.0,
        pytest.approx(2 / 3),
        0.0,
        0.0,
    ]


def test_repetition_penalty():
    reward = registry.create("repetition_penalty")
    scores = reward(["the cat sat on the mat today", "go go go go go go go", "hi", EMPTY])
    assert scores[0] == 0.0 and scores[2] == 0.0 and scores[3] == 0.0
    assert scores[1] == pytest.approx(-1.0 * (1 - 1 / 5))
    with pytest.raises(ValueError):
        registry.get("repetition_penalty")(max_penalty=0.5)


def test_cosine_scaled():
    reward = registry.create({"type": "cosine_scaled", "max_len": 100})
    short_right, long_right = "\\boxed{72}", "x" * 90 + "\\boxed{72}"
    short_wrong, long_wrong = "\\boxed{7}", "x" * 90 + "\\boxed{7}"
    s = reward([short_right, long_right, short_wrong, long_wrong, EMPTY], solution="72")
    assert 0.5 <= s[1] < s[0] <= 1.0
    assert -1.0 <= s[2] < s[3] <= -0.5
    assert s[4] == pytest.approx(-1.0)  # empty is a wrong answer of length 0
    assert all(math.isfinite(v) for v in s)


def test_crossword_format():
    reward = registry.create("crossword_format")
    good = "1 Across: HELLO\n2-Down: WORLD"
    half = "1 Across: HELLO\nI think 2 down is world"
    assert reward([good, half, "<think>1 Across: X</think>", EMPTY]) == [1.0, 0.5, 0.0, 0.0]
    assert parse_crossword_answers("3A: cat\n4 d = dog") == {"3-Across": "CAT", "4-Down": "DOG"}
    expected = {"1-Across": 5, "2-Down": 4}
    assert reward([good, "1 Across: HELLO\n2 Down: TREE"], expected_lengths=expected) == [0.5, 1.0]


GITA = "dharmakṣetre kurukṣetre samavetā yuyutsavaḥ\nmāmakāḥ pāṇḍavāś caiva kim akurvata sañjaya"
GITA_DEV = "धर्मक्षेत्रे कुरुक्षेत्रे समवेता युयुत्सवः ।\nमामकाः पाण्डवाश्चैव किमकुर्वत सञ्जय ॥"


def test_chandas_scansion_by_hand():
    assert scan("dharmakṣetre") == "GGGG"  # dhar-ma-kṣe-tre: rm, kṣ clusters, long e
    assert scan("rāma") == "GL"
    assert scan("aham") == "LL"
    assert devanagari_to_iast("राम") == "rāma"
    assert scan(GITA_DEV.splitlines()[0]) == scan(GITA.splitlines()[0])


def test_chandas_meter():
    reward = registry.create("chandas_meter", meter="anushtubh")
    prose = "this is not a verse at all, only some english words in a line"
    scores = reward([GITA, GITA_DEV, prose, EMPTY])
    assert scores[0] == 1.0 and scores[1] == 1.0
    assert scores[2] < 0.5 and scores[3] == 0.0
    assert meter_score(GITA, "indravajra") < 1.0
    with pytest.raises(ValueError, match="unknown meter"):
        registry.create({"type": "chandas_meter", "meter": "haiku"})
