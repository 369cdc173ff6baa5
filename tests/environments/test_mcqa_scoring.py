"""mcqa: letter extraction and scoring, gold normalisation, bad rows."""

from __future__ import annotations

import pytest

from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from environments.mcqa_thinking_env import (
    MCQAConfig,
    MCQAThinkingEnv,
    answer_letter,
    extract_letter,
    format_question,
    score_letter,
)
from tests.environments.env_helpers import write_jsonl


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>Paris is the capital</think>\\boxed{B}", 1.0),  # right
        ("The answer is (B).", 1.0),  # right, plain phrasing
        ("<think>maybe \\boxed{B}</think>\\boxed{C}", -1.0),  # wrong (think ignored)
        ("\\boxed{B} or \\boxed{C}", -1.0),  # ambiguous
        ("\\boxed{Z}", -1.0),  # out of range
        ("I think it's Paris", -1.0),  # malformed: no letter
        ("", -1.0),  # empty
    ],
)
def test_score_letter(text, expected):
    assert score_letter(text, "B", 4) == expected


def test_extract_letter_prefers_boxed_over_prose():
    assert extract_letter("The answer is A... final: \\boxed{c}", 4) == "C"


@pytest.mark.parametrize(
    "answer, n, letter",
    [
        (0, 4, "A"),
        (3, 4, "D"),
        (4, 4, None),
        ("b", 4, "B"),
        ("2", 3, "C"),
        ("E", 4, None),
        (True, 4, None),
        (None, 4, None),
        ([1], 4, None),
    ],
)
def test_answer_letter(answer, n, letter):
    assert answer_letter(answer, n) == letter


def test_format_question_lists_lettered_choices():
    assert format_question("Q?", ["x", "y"]) == "Q?\n\nA. x\nB. y"


async def test_bad_rows_are_skipped_and_counted(tmp_path):
    path = write_jsonl(
        tmp_path / "m.jsonl",
        [
            {"question": "ok", "choices": ["a", "b"], "answer": 0},
            {"question": "one choice", "choices": ["a"], "answer": 0},
            {"question": "bad", "choices": ["a", "b"], "answer": "Q"},
            {"choices": ["a", "b"], "answer": 0},
        ],
    )
    server = APIServerConfig(
        base_url="http://127.0.0.1:9/v1", model_name="m", server_type="vllm", health_check=False
    )
    env = MCQAThinkingEnv(MCQAConfig(data_path=str(path), tokenizer_name="unused"), server)
    await env.setup()
    assert len(env.train) == 1 and env.train[0]["gold"] == "A"
    assert dict(env.skips.counts) == {"bad_choices": 1, "bad_answer": 1, "missing_question": 1}
