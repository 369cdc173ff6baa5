"""environments/configs/example.yaml parses and layers under the command line."""

from __future__ import annotations

from atroposlib.envs.cli import parse_cli
from environments.gsm8k_server import GSM8kEnv

EXAMPLE = "environments/configs/example.yaml"


def test_example_yaml_sets_every_layer_and_cli_wins():
    parsed = parse_cli(GSM8kEnv, ["serve", "--config", EXAMPLE, "--env.max_token_length", "1024"])
    env = parsed.env_config
    assert env.group_size == 8 and env.wandb_name == "gsm8k" and env.eval_temperature == 0.6
    assert env.max_token_length == 1024  # CLI > YAML
    assert env.use_wandb is False  # YAML > config_init (True)
    servers = parsed.server_configs
    assert [s.base_url for s in servers] == ["http://localhost:9001/v1", "http://localhost:9002/v1"]
    assert all(s.server_type == "vllm" for s in servers)
    assert parsed.slurm is False and parsed.testing is False
