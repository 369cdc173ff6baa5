"""gsm8k: answer extraction, math-verify scoring, length penalty, group dropping, data hygiene."""

from __future__ import annotations

import json

import pytest

from atroposlib.envs.reward_fns.math_answers import parse_gold
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from environments.gsm8k_server import (
    GSM8kConfig,
    GSM8kEnv,
    gold_from_answer,
    length_penalty_scores,
    score_response,
)
from tests.environments.env_helpers import write_jsonl

SERVER = APIServerConfig(
    base_url="http://127.0.0.1:9/v1", model_name="m", server_type="vllm", health_check=False
)


@pytest.mark.parametrize(
    "answer, gold",
    [
        ("2 + 3 = 5\n#### 5", "5"),
        ("lots of # signs # here\n#### 1,234", "1234"),
        ("#### -7 ", "-7"),
    ],
)
def test_gold_is_the_text_after_the_last_hash_without_commas(answer, gold):
    assert gold_from_answer(answer) == gold


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>2+3 is 5</think>The answer is \\boxed{5}", 1.0),  # right
        ("\\boxed{5}", 1.0),  # right, no thinking
        ("<think>\\boxed{5}</think> so \\boxed{6}", -1.0),  # wrong after the think block
        ("<think>maybe \\boxed{5}</think> I give up", -1.0),  # boxed only inside think
        ("The answer is 5", -1.0),  # malformed: not boxed
        ("\\boxed{", -1.0),  # malformed latex
        ("", -1.0),  # empty
    ],
)
def test_score_response(text, expected):
    assert score_response(text, parse_gold("5")) == expected


def test_length_penalty_by_hand():
    assert length_penalty_scores([10, 50, 75, 100, 500], 100) == [1.0, 1.0, 0.5, 0.0, 0.0]


def _env(tmp_path=None, **cfg):
    config = GSM8kConfig(group_size=2, tokenizer_name="unused", max_token_length=100, **cfg)
    return GSM8kEnv(config, SERVER)


def _rollout(answer_text, n_tokens=20, prompt=5):
    return {
        "messages": [{"role": "assistant", "content": answer_text}],
        "finish_reason": "stop",
        "tokens": list(range(n_tokens)),
        "masks": [-100] * prompt + list(range(prompt, n_tokens)),
        "logprobs": [1.0] * prompt + [-0.5] * (n_tokens - prompt),
    }


async def test_score_keeps_a_mixed_group_with_logprobs():
    group = await _env().score([_rollout("\\boxed{4}"), _rollout("\\boxed{5}")], "4")
    assert sorted(group["scores"]) == [-1.0, 1.0]
    assert all(
        len(lp) == len(t)
        for lp, t in zip(group["inference_logprobs"], group["tokens"], strict=True)
    )


async def test_all_correct_group_gets_length_penalty():
    group = await _env(ensure_scores_are_not_same=False).score(
        [_rollout("\\boxed{4}", n_tokens=40), _rollout("\\boxed{4}", n_tokens=80)], "4"
    )
    assert sorted(group["scores"]) == [pytest.approx(0.4), 1.0]


async def test_equal_scores_drop_the_group_unless_disabled():
    wrong = [_rollout("\\boxed{1}"), _rollout("nothing")]
    assert await _env().score(wrong, "4") is None
    kept = await _env(ensure_scores_are_not_same=False).score(wrong, "4")
    assert kept["scores"] == [-1.0, -1.0]


async def test_short_rollouts_and_unparseable_gold_are_dropped_and_counted():
    env = _env(ensure_scores_are_not_same=False)
    group = await env.score([_rollout("\\boxed{4}", n_tokens=8), _rollout("\\boxed{5}")], "4")
    assert (
        len(group["tokens"]) == 1
    )  # the 3-token completion is dropped; BaseEnv rejects the short group
    assert await env.score([_rollout("\\boxed{4}")], "}{") is None
    assert env.skips.counts["gold_unparseable"] == 1


async def test_setup_skips_bad_rows_and_items_cycle(tmp_path):
    data = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"question": "q1", "answer": "#### 1"},
            {"question": "q2"},
            "{broken",
            {"answer": "#### 3"},
            {"question": ["not", "text"], "answer": "#### 4"},
            {"question": "q5", "answer": "no marker"},
            {"question": "q6", "answer": "#### 6"},
        ],
    )
    env = _env(data_path=str(data))
    await env.setup()
    assert sorted(i["gold_answer"] for i in env.train) == ["1", "6"]
    assert dict(env.skips.counts) == {
        "missing_answer": 1,
        "not_json": 1,
        "missing_question": 1,
        "non_text_fields": 1,
        "no_final_answer": 1,
    }
    first = [await env.get_next_item() for _ in range(3)]
    assert first[0] == first[2] and first[0] != first[1]


async def test_setup_without_usable_rows_fails_clearly(tmp_path):
    env = _env(data_path=str(write_jsonl(tmp_path / "d.jsonl", [{"question": "q"}])))
    with pytest.raises(ValueError, match="no usable training rows"):
        await env.setup()


def test_checkpoint_round_trips_iter(tmp_path):
    env = _env()
    env.checkpoint_dir, env.wandb_prepend = str(tmp_path), "gsm8k_0"
    env.iter = 17
    env.save_checkpoint(5)
    saved = list(tmp_path.rglob("*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text()) == {"iter": 17}
    env.iter, env.curr_step = 0, 5
    env.load_checkpoint()
    assert env.iter == 17


def test_config_init_matches_the_original_defaults():
    env_config, server = GSM8kEnv.config_init()
    assert (
        env_config.group_size,
        env_config.batch_size,
        env_config.total_steps,
        env_config.steps_per_eval,
        env_config.max_token_length,
        env_config.use_wandb,
        env_config.wandb_name,
    ) == (8, 12, 1000, 100, 2048, True, "gsm8k")
    assert env_config.tokenizer_name == "NousResearch/DeepHermes-3-Llama-3-3B-Preview"
    assert (server.base_url, server.api_key, server.num_requests_for_eval) == (
        "http://localhost:9001/v1",
        "x",
        256,
    )
    assert env_config.eval_temperature == 0.6


async def test_setup_goes_through_load_dataset_without_a_data_path(tmp_path):
    """The hub code path (``datasets.load_dataset``), offline: a local dataset directory."""
    write_jsonl(
        tmp_path / "train.jsonl", [{"question": "q1", "answer": "#### 1"}, {"question": "q2"}]
    )
    write_jsonl(tmp_path / "test.jsonl", [{"question": "t1", "answer": "#### 3"}])
    env = _env(dataset_name=str(tmp_path), dataset_config=None)
    await env.setup()
    assert [i["gold_answer"] for i in env.train] == ["1"] and [
        i["gold_answer"] for i in env.test
    ] == ["3"]
    assert dict(env.skips.counts) == {"missing_answer": 1}
