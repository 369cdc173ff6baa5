"""The procedurally generated arithmetic task: scoring, problem sets and prompts."""

from __future__ import annotations

import random

import pytest

from environments.arithmetic_server import (
    all_problems,
    answer_text,
    problem_messages,
    prompt_ids,
    sample_problem,
    score_completion,
    sft_examples,
    split_problems,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("7", 1.0),
        (" 7 ", 1.0),
        ("7<|im_end|>", 1.0),
        ("7<|im_end|>junk", 1.0),
        ("8", 0.0),
        ("7 8", 0.0),
        ("seven", 0.0),
        ("", 0.0),
        ("07", 1.0),
        ("-7", 0.0),
        ("7.0", 0.0),
    ],
)
def test_score_is_exact_match_of_the_sum(text, expected):
    assert score_completion(text, 3, 4) == expected


def test_all_problems_is_every_pair_once():
    probs = all_problems(9)
    assert len(probs) == 100 and len(set(probs)) == 100
    assert all(0 <= a <= 9 and 0 <= b <= 9 for a, b in probs)


def test_sampling_is_seeded_and_in_range():
    r1, r2 = random.Random(5), random.Random(5)
    a = [sample_problem(r1, 4) for _ in range(50)]
    assert a == [sample_problem(r2, 4) for _ in range(50)]
    assert all(0 <= x <= 4 and 0 <= y <= 4 for x, y in a)
    assert not set(a) & set(split_problems(4)[1])  # never a held-out problem


def test_sft_examples_pair_prompt_with_correct_answer():
    ex = sft_examples(20, seed=1)
    assert len(ex) == 20 and ex == sft_examples(20, seed=1)
    for messages, answer in ex:
        a, b = map(int, messages[0]["content"].rstrip("=").split("+"))
        assert answer == answer_text(a, b) and score_completion(answer, a, b) == 1.0


def test_prompt_ids_end_with_assistant_generation_prompt(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ids = prompt_ids(tok, 3, 4)
    text = tok.decode(ids)
    assert "03+04=" in text and text.rstrip().endswith("assistant")
    assert problem_messages(3, 4) == [{"role": "user", "content": "03+04="}]
    assert problem_messages(3, 4, max_operand=9) == [{"role": "user", "content": "3+4="}]


def test_local_greedy_eval_scores_an_in_process_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from environments.arithmetic_server import local_greedy_eval

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    model.train()
    score = local_greedy_eval(model, tok, max_operand=3)
    assert 0.0 <= score <= 1.0 and model.training  # training mode restored
