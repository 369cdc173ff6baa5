"""Every environment runs in ``process`` mode against a real ``atropos-serve-model``
(tiny offline model) and writes well-formed groups (jsonl + html).

The environments run concurrently in one event loop (the server batches their
requests), once per module; each test then checks one environment's output. The tiny
random model writes gibberish, so these tests pin structure, not correctness.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Dict

import pytest

from atroposlib.envs.cli import build_env, parse_cli
from environments.blackjack_server import BlackjackEnv
from environments.dataset_environment.dataset_env import DatasetEnv
from environments.gsm8k_server import GSM8kEnv
from environments.mcqa_thinking_env import MCQAThinkingEnv
from environments.rlaif_server import RLAIFEnv
from environments.tool_calling_server import SingleToolCallingEnv
from environments.tool_use_multiturn_server import MultiTurnToolUseEnv
from tests.environments.env_helpers import check_groups, process_argv, unmasked_runs, write_jsonl

GSM8K_ROWS = [
    {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"},
    {"question": "Tom has 4 apples and eats 1. How many are left?", "answer": "4 - 1 = 3\n#### 3"},
    {"question": "A row without an answer"},
    "this line is not json",
    {"question": "An answer without the final marker", "answer": "it is 7"},
    {"question": "What is 10 * 100?", "answer": "10 * 100 = 1,000\n#### 1,000"},
]
MCQA_ROWS = [
    {
        "question": "What is the capital of France?",
        "choices": ["Berlin", "Paris", "Rome", "Madrid"],
        "answer": 1,
    },
    {"question": "2 + 2 = ?", "choices": ["3", "4"], "answer": "B"},
    {"question": "An answer index out of range", "choices": ["a", "b"], "answer": 7},
]
TOOL_ROWS = [
    {
        "query": "What's the weather in Paris?",
        "tools": [
            {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            }
        ],
        "expected_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}],
    },
    {
        "conversations": [
            {"from": "system", "value": 'You can call <tools>[{"name": "add"}]</tools>'},
            {"from": "human", "value": "Add 2 and 3"},
            {
                "from": "gpt",
                "value": '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
            },
        ]
    },
    {"query": "A row without tools"},
]
PROMPT_ROWS = [
    {"prompt": "Say hello to a friend."},
    {"prompt": "Describe the sea in one line."},
    {"conversation": [{"role": "user", "content": "What is a cat?"}]},
    {"unrelated": 1},
]
EVAL_EXTRA = {  # keep every evaluation to one or two short requests
    "mcqa": ["--env.max_eval_items", "1"],
    "blackjack": ["--env.eval_episodes", "1", "--env.max_turns", "1"],
    "tool_calling": ["--env.eval_holdout", "1"],
    "multiturn_tool_use": ["--env.eval_episodes", "1", "--env.max_turns", "1"],
    "rlaif": ["--env.eval_holdout", "1"],
    "dataset": ["--env.eval_holdout", "1"],
}
EVAL_METRIC = {
    "mcqa": "eval/accuracy",
    "blackjack": "eval/mean_reward",
    "tool_calling": "eval/percent_correct",
    "multiturn_tool_use": "eval/percent_correct",
    "rlaif": "eval/mean_rating",
    "dataset": "eval/mean_score",
}
DATASET_YAML = """
env:
  prompt_field: question
  answer_field: answer
  answer_after: "####"
  max_token_length: 12
  reward_functions:
    - accuracy
    - {type: format, weight: 0.5, params: {preferred_tags: [think]}}
"""


def _runs(tmp: Path, serve: Dict[str, str]) -> Dict[str, Any]:
    gsm = write_jsonl(tmp / "gsm8k_data.jsonl", GSM8K_ROWS)
    out = {
        name: tmp / f"{name}.jsonl"
        for name in (
            "gsm8k",
            "mcqa",
            "blackjack",
            "tool_calling",
            "multiturn_tool_use",
            "rlaif",
            "dataset",
        )
    }
    (tmp / "dataset.yaml").write_text(DATASET_YAML)
    runs = {
        "gsm8k": (
            GSM8kEnv,
            process_argv(
                serve, out["gsm8k"], "--env.data_path", str(gsm), "--env.max_token_length", "16"
            ),
        ),
        "gsm8k_eval": (
            GSM8kEnv,
            [
                "evaluate",
                "--env.data_path",
                str(gsm),
                "--env.max_eval_items",
                "2",
                "--env.max_token_length",
                "8",
                "--env.tokenizer_name",
                serve["model"],
                "--env.use_wandb",
                "false",
                "--env.data_dir_to_save_evals",
                str(tmp / "evals"),
                "--openai.base_url",
                serve["base_url"],
                "--openai.model_name",
                serve["model"],
                "--openai.server_type",
                "vllm",
            ],
        ),
        "mcqa": (
            MCQAThinkingEnv,
            process_argv(
                serve,
                out["mcqa"],
                "--env.max_token_length",
                "12",
                "--env.data_path",
                str(write_jsonl(tmp / "mcqa_data.jsonl", MCQA_ROWS)),
            ),
        ),
        "blackjack": (
            BlackjackEnv,
            process_argv(
                serve,
                out["blackjack"],
                "--env.max_turns",
                "3",
                "--env.max_tokens_per_turn",
                "6",
                "--env.max_token_length",
                "512",
                "--env.on_invalid_action",
                "hit",
            ),
        ),
        "tool_calling": (
            SingleToolCallingEnv,
            process_argv(
                serve,
                out["tool_calling"],
                "--env.max_token_length",
                "12",
                "--env.eval_holdout",
                "0",
                "--env.data_path",
                str(write_jsonl(tmp / "tools_data.jsonl", TOOL_ROWS)),
            ),
        ),
        "multiturn_tool_use": (
            MultiTurnToolUseEnv,
            process_argv(
                serve,
                out["multiturn_tool_use"],
                "--env.max_turns",
                "2",
                "--env.max_tokens_per_turn",
                "8",
                "--env.max_token_length",
                "1024",
            ),
        ),
        "rlaif": (
            RLAIFEnv,
            process_argv(
                serve,
                out["rlaif"],
                "--env.max_token_length",
                "12",
                "--env.judge_max_tokens",
                "8",
                "--env.eval_holdout",
                "0",
                "--env.data_path",
                str(write_jsonl(tmp / "prompts.jsonl", PROMPT_ROWS)),
            ),
        ),
        "dataset": (
            DatasetEnv,
            process_argv(
                serve,
                out["dataset"],
                "--config",
                str(tmp / "dataset.yaml"),
                "--env.data_path",
                str(gsm),
            ),
        ),
    }
    for name, (cls, argv) in list(runs.items()):
        if name.endswith("_eval") or f"{name}_eval" in runs:
            continue
        eval_argv = (
            ["evaluate"]
            + [a for a in argv[1:]]
            + [
                "--env.data_dir_to_save_evals",
                str(tmp / f"evals_{name}"),
                *EVAL_EXTRA.get(name, []),
            ]
        )
        runs[f"{name}_eval"] = (cls, eval_argv)
    return runs, out


@pytest.fixture(scope="module")
def processed(serve_model, tmp_path_factory):
    """Run every environment once, concurrently; ``{name: (env, error)}`` plus the paths."""
    tmp = tmp_path_factory.mktemp("process")
    runs, out = _runs(tmp, serve_model)
    envs = {}
    for name, (cls, argv) in runs.items():
        parsed = parse_cli(cls, argv)
        envs[name] = build_env(cls, parsed)

    async def run_all():
        coros = [
            env.run_evaluate() if name.endswith("_eval") else env.process_manager()
            for name, env in envs.items()
        ]
        return await asyncio.gather(*coros, return_exceptions=True)

    results = asyncio.run(run_all())
    errors = {
        name: r for name, r in zip(envs, results, strict=True) if isinstance(r, BaseException)
    }
    return {"envs": envs, "errors": errors, "out": out, "tmp": tmp}


def _ok(processed, name):
    assert name not in processed["errors"], repr(processed["errors"].get(name))
    return processed["envs"][name]


def test_gsm8k_process_writes_scored_groups_and_skips_bad_rows(processed):
    env = _ok(processed, "gsm8k")
    groups = check_groups(processed["out"]["gsm8k"], 2, 2, -1.0, 1.0)
    assert all(
        g["messages"][0][0]["role"] == "system" and "\\boxed" in g["messages"][0][0]["content"]
        for g in groups
    )
    assert dict(env.skips.counts) == {"missing_answer": 1, "not_json": 1, "no_final_answer": 1}
    assert len(env.train) == 3 and env.iter >= 2


def test_gsm8k_evaluate_writes_metrics_and_samples(processed):
    _ok(processed, "gsm8k_eval")
    metrics = json.loads((processed["tmp"] / "evals" / "metrics.json").read_text())
    results = metrics["results"]["all"]
    assert 0.0 <= results["eval/percent_correct"] <= 1.0
    assert metrics["config_general"]["generation_parameters"]["temperature"] == 0.6
    samples = [
        json.loads(x)
        for x in (processed["tmp"] / "evals" / "samples.jsonl").read_text().splitlines()
    ]
    assert len(samples) == 2
    assert {
        "messages",
        "question",
        "gold_answer",
        "gold_parsed",
        "model_parsed",
        "score",
        "correct",
        "finish_reason",
        "response_after_think",
    } <= set(samples[0])


def test_mcqa_process_writes_scored_groups(processed):
    env = _ok(processed, "mcqa")
    check_groups(processed["out"]["mcqa"], 2, 2, -1.0, 1.0)
    assert env.skips.counts["bad_answer"] == 1


def test_blackjack_keeps_one_aligned_sequence_per_game(processed):
    _ok(processed, "blackjack")
    groups = check_groups(processed["out"]["blackjack"], 2, 2, -1.0, 1.0)
    multi_turn = 0
    for group in groups:
        for masks, messages in zip(group["masks"], group["messages"], strict=True):
            turns = sum(1 for m in messages if m["role"] == "assistant")
            assert unmasked_runs(masks) == turns  # each model turn trained, observations masked
            multi_turn += turns > 1
    assert multi_turn > 0, "no game lasted more than one turn"


def test_tool_calling_process_writes_scored_groups(processed):
    env = _ok(processed, "tool_calling")
    check_groups(processed["out"]["tool_calling"], 2, 2, -1.0, 1.0)
    assert env.skips.counts["missing_tools"] == 1


def test_multiturn_tool_use_process_writes_scored_groups(processed):
    _ok(processed, "multiturn_tool_use")
    groups = check_groups(processed["out"]["multiturn_tool_use"], 2, 2, -1.0, 1.0)
    for group in groups:
        for masks, messages in zip(group["masks"], group["messages"], strict=True):
            assert unmasked_runs(masks) == sum(1 for m in messages if m["role"] == "assistant")


def test_rlaif_process_writes_scored_groups(processed):
    env = _ok(processed, "rlaif")
    check_groups(processed["out"]["rlaif"], 2, 2, -1.0, 1.0)
    assert env.skips.counts["missing_prompt"] == 1


def test_dataset_env_process_uses_yaml_rewards(processed):
    env = _ok(processed, "dataset")
    check_groups(processed["out"]["dataset"], 2, 2, 0.0, 1.5)
    assert [r.name for r in env.reward.reward_functions] == ["accuracy", "format"]
    assert env.reward.reward_functions[1].weight == 0.5
    assert env.config.max_token_length == 12  # from the YAML layer


@pytest.mark.parametrize("name", sorted(EVAL_METRIC))
def test_evaluate_mode_writes_metrics_and_samples(processed, name):
    _ok(processed, f"{name}_eval")
    directory = processed["tmp"] / f"evals_{name}"
    metrics = json.loads((directory / "metrics.json").read_text())
    assert EVAL_METRIC[name] in metrics["results"]["all"]
    assert metrics["results"][f"atropos|{name}_eval|0"] == metrics["results"]["all"]
    assert (directory / "samples.jsonl").read_text().strip(), "no evaluation sample written"
