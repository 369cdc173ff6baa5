"""dataset environment: YAML-chosen rewards, field mapping and config validation."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from atroposlib.envs.cli import parse_cli
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from environments.dataset_environment.dataset_env import DatasetEnv, DatasetEnvConfig
from tests.environments.env_helpers import write_jsonl

SERVER = APIServerConfig(
    base_url="http://127.0.0.1:9/v1", model_name="m", server_type="vllm", health_check=False
)


def test_unknown_reward_is_refused_naming_the_known_ones():
    with pytest.raises(ValidationError, match="unknown reward function 'nope'.*accuracy"):
        DatasetEnvConfig(reward_functions=["nope"])
    with pytest.raises(ValidationError, match="no 'type'"):
        DatasetEnvConfig(reward_functions=[{"weight": 1.0}])
    with pytest.raises(ValidationError, match="at least one"):
        DatasetEnvConfig(reward_functions=[])
    with pytest.raises(ValidationError, match="prompt"):
        DatasetEnvConfig(prompt_template="no placeholder")


async def test_rows_map_fields_skip_bad_rows_and_score_with_combined_rewards(tmp_path):
    data = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"q": "2+2?", "a": "work\n#### 4"},
            {"q": "no answer"},
            {"q": "empty after marker", "a": "####  "},
            {"q": "3+3?", "a": "#### 6"},
        ],
    )
    config = DatasetEnvConfig(
        data_path=str(data),
        prompt_field="q",
        answer_field="a",
        answer_after="####",
        eval_holdout=0,
        system_prompt="S",
        prompt_template="Solve: {prompt}",
        tokenizer_name="unused",
        reward_functions=[
            {"type": "accuracy", "weight": 1.0},
            {"type": "format", "weight": 0.5, "params": {"preferred_tags": ["think"]}},
        ],
    )
    env = DatasetEnv(config, SERVER)
    await env.setup()
    assert sorted(i["answer"] for i in env.train) == ["4", "6"]
    assert dict(env.skips.counts) == {"missing_a": 1, "empty_answer_after_marker": 1}
    item = next(i for i in env.train if i["answer"] == "4")
    assert env.messages_for(item) == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Solve: 2+2?"},
    ]
    scores = env.score(
        ["<think>2+2</think>\\boxed{4}", "\\boxed{4}", "<think>x</think>\\boxed{5}", ""], "4"
    )
    assert scores == [1.5, 1.0, 0.5, 0.0]


def test_shipped_yaml_config_parses_with_its_rewards(tmp_path):
    parsed = parse_cli(
        DatasetEnv,
        [
            "process",
            "--config",
            "environments/dataset_environment/configs/gsm8k.yaml",
            "--env.group_size",
            "3",
        ],
    )
    cfg = parsed.env_config
    assert (cfg.dataset_name, cfg.prompt_field, cfg.answer_after, cfg.group_size) == (
        "gsm8k",
        "question",
        "####",
        3,
    )
    assert [r if isinstance(r, str) else r["type"] for r in cfg.reward_functions] == [
        "accuracy",
        "format",
    ]
