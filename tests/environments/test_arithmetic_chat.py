"""environments/arithmetic_chat_server.py: the exact-answer reward and the held-out split."""

from __future__ import annotations

from environments.arithmetic_chat_server import (
    EVAL_SIZE,
    MAX_OPERAND,
    greedy_eval,
    problem_messages,
    score_reply,
)
from environments.arithmetic_server import split_problems


def test_only_the_bare_sum_scores():
    assert score_reply("32<|im_end|>", 17, 15) == 1.0
    assert score_reply(" 32\n", 17, 15) == 1.0
    for wrong in ("32.", "The answer is 32.", "31", "", "3 2", "32 apples"):
        assert score_reply(wrong, 17, 15) == 0.0, wrong


def test_prompt_has_one_example_and_the_eval_set_is_held_out():
    msgs = problem_messages(4, 9)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[-1]["content"] == "4 + 9 ="
    train, held = split_problems(MAX_OPERAND, EVAL_SIZE)
    assert len(held) == EVAL_SIZE and not set(train) & set(held)
    assert len(train) + len(held) == (MAX_OPERAND + 1) ** 2
    assert greedy_eval.eval_set["size"] == EVAL_SIZE and greedy_eval.eval_set["held_out"]
