"""``adapter_config_init``: the defaults both bundled adapters start from."""

from __future__ import annotations

import pytest

from atroposlib.envs.adapters._defaults import adapter_config_init
from atroposlib.envs.adapters.reasoning_gym import ReasoningGymEnv, ReasoningGymEnvConfig
from atroposlib.envs.adapters.textarena import TextArenaEnv, TextArenaEnvConfig


@pytest.mark.parametrize(
    "env_cls, config_cls, name, max_len",
    [
        (ReasoningGymEnv, ReasoningGymEnvConfig, "reasoning_gym", 2048),
        (TextArenaEnv, TextArenaEnvConfig, "textarena", 4096),
    ],
)
def test_each_adapter_keeps_its_name_and_length_over_the_shared_defaults(
    env_cls, config_cls, name, max_len
):
    env, servers = env_cls.config_init()
    assert type(env) is config_cls
    assert (env.wandb_name, env.max_token_length) == (name, max_len)
    assert (env.tokenizer_name, env.group_size, env.batch_size) == ("none", 8, -1)
    assert (env.steps_per_eval, env.total_steps, env.use_wandb) == (100, 1000, False)
    assert len(servers) == 1
    server = servers[0]
    assert (server.model_name, server.base_url, server.api_key, server.server_type) == (
        "default",
        "http://localhost:9001/v1",
        "x",
        "vllm",
    )
    # The shared defaults count as set, so a YAML or CLI layer sees them as the adapter's own.
    assert {"wandb_name", "max_token_length", "group_size"} <= env.model_fields_set


def test_each_call_builds_fresh_configs():
    first, first_servers = adapter_config_init(TextArenaEnvConfig, "a", max_token_length=16)
    second, second_servers = adapter_config_init(TextArenaEnvConfig, "b", max_token_length=32)
    assert first is not second and first_servers[0] is not second_servers[0]
    assert (first.wandb_name, second.max_token_length) == ("a", 32)
