"""The environment command line: precedence, modes, YAML, and errors (exit code 2)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import yaml

from atroposlib.envs.base import BaseEnvConfig
from atroposlib.envs.cli import CliError, parse_cli, run_cli, write_evaluate_config
from atroposlib.envs.server_handling.server_baseline import APIServerConfig, ServerBaseline

from .trivial_env import TrivialEnv

TRIVIAL = Path(__file__).with_name("trivial_env.py")


def parse(*argv: str):
    return parse_cli(TrivialEnv, list(argv), prog="trivial_env.py")


def write_yaml(tmp_path: Path, data: dict) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_class_default_applies_when_config_init_leaves_field_alone():
    parsed = parse("serve")
    assert parsed.env_config.max_batches_offpolicy == BaseEnvConfig().max_batches_offpolicy == 3


def test_config_init_overrides_class_default():
    parsed = parse("serve")
    assert parsed.env_config.group_size == 4 and BaseEnvConfig().group_size == 4
    assert parsed.env_config.total_steps == 10  # class default is 1000
    assert parsed.env_config.wandb_name == "trivial"


def test_yaml_overrides_config_init(tmp_path):
    cfg = write_yaml(tmp_path, {"env": {"total_steps": 77}, "openai": {"model_name": "from-yaml"}})
    parsed = parse("serve", "--config", cfg)
    assert parsed.env_config.total_steps == 77
    assert parsed.server_configs[0].model_name == "from-yaml"
    assert parsed.server_configs[0].base_url == "http://127.0.0.1:9001/v1"  # config_init kept


def test_cli_overrides_yaml(tmp_path):
    cfg = write_yaml(
        tmp_path, {"env": {"total_steps": 77, "group_size": 2}, "openai": {"model_name": "y"}}
    )
    parsed = parse("serve", "--config", cfg, "--env.total_steps", "5", "--openai.model_name=cli")
    assert parsed.env_config.total_steps == 5
    assert parsed.env_config.group_size == 2  # YAML value not overridden by CLI stays
    assert parsed.server_configs[0].model_name == "cli"


def test_bare_bool_flag_means_true_and_explicit_false_works():
    assert parse("serve", "--slurm").slurm is True
    assert parse("serve", "--slurm", "false").slurm is False
    assert parse("serve", "--env.use_wandb", "--testing").env_config.use_wandb is True
    assert parse("serve", "--env.use_wandb", "False").env_config.use_wandb is False


def test_none_literal_becomes_none():
    parsed = parse("serve", "--env.wandb_name", "None")
    assert parsed.env_config.wandb_name is None


def test_process_mode_defaults_and_forced_values(tmp_path):
    parsed = parse("process", "--env.ensure_scores_are_not_same", "true")
    cfg = parsed.env_config
    assert cfg.ensure_scores_are_not_same is False  # forced
    assert cfg.include_messages is True  # forced
    assert cfg.use_wandb is True  # mode default over config_init's False
    assert cfg.data_path_to_save_groups == "data/trivial.jsonl"
    assert parse("process", "--env.use_wandb", "false").env_config.use_wandb is False


def test_yaml_list_of_servers_gives_one_config_each(tmp_path):
    servers = [{"base_url": f"http://127.0.0.1:{p}/v1", "model_name": "m"} for p in (9001, 9002)]
    parsed = parse("serve", "--config", write_yaml(tmp_path, {"openai": servers}))
    assert [s.base_url for s in parsed.server_configs] == [s["base_url"] for s in servers]


def test_yaml_server_list_combined_with_openai_flag_is_an_error(tmp_path):
    servers = [{"base_url": f"http://127.0.0.1:{p}/v1"} for p in (9001, 9002)]
    with pytest.raises(CliError, match="openai"):
        parse(
            "serve",
            "--config",
            write_yaml(tmp_path, {"openai": servers}),
            "--openai.model_name",
            "x",
        )


@pytest.mark.parametrize("mode", ["serve", "process"])
def test_yaml_one_entry_server_list_is_a_single_server_dict(tmp_path, mode):
    # A one-element ``openai:`` list is the same as the dict form: its values beat the
    # defaults from config_init, and the fields it leaves out keep those defaults.
    entry = {"base_url": "http://127.0.0.1:9555/v1", "model_name": "from-list"}
    parsed = parse(mode, "--config", write_yaml(tmp_path, {"openai": [entry]}))
    assert len(parsed.server_configs) == 1
    server = parsed.server_configs[0]
    assert (server.base_url, server.model_name) == (entry["base_url"], "from-list")
    assert server.api_key == "x"  # config_init kept


def test_cli_flag_overrides_a_one_entry_yaml_server_list(tmp_path):
    entry = {"base_url": "http://127.0.0.1:9555/v1", "model_name": "from-list"}
    cfg = write_yaml(tmp_path, {"openai": [entry]})
    parsed = parse("serve", "--config", cfg, "--openai.base_url", "http://127.0.0.1:9666/v1")
    assert len(parsed.server_configs) == 1
    server = parsed.server_configs[0]
    assert (server.base_url, server.model_name) == ("http://127.0.0.1:9666/v1", "from-list")


@pytest.mark.parametrize("servers", [[5], [{"model_name": "m"}, "x"]])
def test_yaml_server_list_entry_that_is_not_a_mapping_is_reported(tmp_path, servers):
    with pytest.raises(CliError, match="'openai' must be a mapping or a list of mappings"):
        parse("serve", "--config", write_yaml(tmp_path, {"openai": servers}))


def test_server_baseline_default_is_kept_without_overrides():
    class BaselineEnv(TrivialEnv):
        @classmethod
        def config_init(cls):
            return BaseEnvConfig(wandb_name="b"), ServerBaseline(model_name="base")

    parsed = parse_cli(BaselineEnv, ["serve"], prog="x")
    assert type(parsed.server_configs) is ServerBaseline
    converted = parse_cli(
        BaselineEnv, ["serve", "--openai.base_url", "http://127.0.0.1:1/v1"], prog="x"
    )
    assert isinstance(converted.server_configs[0], APIServerConfig)
    assert converted.server_configs[0].model_name == "base"


def test_slurm_and_testing_from_yaml_then_cli(tmp_path):
    cfg = write_yaml(tmp_path, {"slurm": True, "testing": True})
    parsed = parse("serve", "--config", cfg, "--testing", "false")
    assert parsed.slurm is True and parsed.testing is False


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["serve", "--env.group_size", "abc"], "--env.group_size"),
        (["serve", "--env.reasoning_effort", "extreme"], "--env.reasoning_effort"),
        (["serve", "--openai.timeout", "soon"], "--openai.timeout"),
        (["serve", "--slurm", "maybe"], "--slurm"),
        (["serve", "--config", "/nonexistent/cfg.yaml"], "--config"),
    ],
)
def test_bad_values_name_the_flag(argv, needle):
    with pytest.raises(CliError, match=needle.replace(".", r"\.")):
        parse(*argv)


def test_bad_yaml_is_reported(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("env: [unclosed")
    with pytest.raises(CliError, match="invalid YAML"):
        parse("serve", "--config", str(path))
    path.write_text("env: 3")
    with pytest.raises(CliError, match="'env' must be a mapping"):
        parse("serve", "--config", str(path))


def test_bad_yaml_value_names_the_field(tmp_path):
    with pytest.raises(CliError, match=r"--env\.total_steps"):
        parse("serve", "--config", write_yaml(tmp_path, {"env": {"total_steps": "many"}}))


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["serve", "--env.no_such_field", "1"], "unrecognized arguments: --env.no_such_field"),
        (["launch"], "invalid choice"),
        ([], "choose a subcommand"),
        (["serve", "--env.group_size", "x"], "--env.group_size"),
    ],
)
def test_run_cli_exits_2_with_a_message(argv, needle, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["trivial_env.py", *argv])
    with pytest.raises(SystemExit) as exc:
        run_cli(TrivialEnv, argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_help_lists_every_field_with_description_and_config_init_default(capsys):
    with pytest.raises(SystemExit) as exc:
        parse("serve", "--help")
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for name, info in TrivialEnv.env_config_cls.model_fields.items():
        assert f"--env.{name}" in out
        if info.description:
            assert " ".join(info.description.split())[:30] in out
    for name in APIServerConfig.model_fields:
        assert f"--openai.{name}" in out
    assert "--slurm" in out and "--testing" in out and "--config" in out
    assert "(default: 10)" in out  # total_steps from config_init, not the class's 1000


def test_evaluate_config_yaml_has_merged_values(tmp_path):
    parsed = parse(
        "evaluate", "--env.data_dir_to_save_evals", str(tmp_path), "--env.group_size", "2"
    )
    path = write_evaluate_config(parsed)
    saved = yaml.safe_load(Path(path).read_text())
    assert saved["env"]["group_size"] == 2
    assert saved["openai"][0]["base_url"] == "http://127.0.0.1:9001/v1"
    assert saved["slurm"] is False


def test_script_exits_2_on_unknown_flag(capsys, monkeypatch):
    """The environment file run as a script (its ``__main__`` block, ``TrivialEnv.cli()``),
    in-process with the script's ``sys.argv``."""
    monkeypatch.setattr(sys, "argv", [str(TRIVIAL), "serve", "--env.bogus", "1"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(TRIVIAL), run_name="__main__")
    assert exc.value.code == 2
    assert "--env.bogus" in capsys.readouterr().err


def test_server_manager_options_are_accepted_and_validated(tmp_path):
    parsed = parse("serve", "--max_n_completions", "2", "--proxy_url", "http://127.0.0.1:9100")
    assert parsed.manager_options == {"max_n_completions": 2, "proxy_url": "http://127.0.0.1:9100"}
    with pytest.raises(CliError, match="--max_n_completions"):
        parse("serve", "--max_n_completions", "0")
    cfg = write_yaml(tmp_path, {"max_n_completions": 3})
    assert parse("serve", "--config", cfg).manager_options["max_n_completions"] == 3


def test_build_env_applies_max_n_completions():
    from atroposlib.envs.cli import build_env

    env = build_env(TrivialEnv, parse("serve", "--max_n_completions", "2"))
    assert env.server.max_n_completions == 2


def test_testing_flag_builds_the_mock_server_harness():
    from atroposlib.envs.cli import build_env
    from atroposlib.envs.server_handling.server_harness import ServerHarness

    env = build_env(TrivialEnv, parse("serve", "--testing"))
    assert [type(s) for s in env.server.servers] == [ServerHarness]


@pytest.mark.parametrize(
    "values, needle",
    [
        ({"config": "/nonexistent/env.yaml"}, "--config /nonexistent/env.yaml: cannot read"),
        ({"max_n_completions": 0}, "--max_n_completions: must be at least 1"),
    ],
)
def test_mode_config_instance_reports_a_bad_value_like_the_command_line(
    values, needle, capsys, monkeypatch
):
    monkeypatch.setattr(sys, "argv", ["trivial_env.py"])
    with pytest.raises(SystemExit) as exc:
        TrivialEnv.get_cli_serve_config_cls()(**values).cli_cmd()
    assert exc.value.code == 2
    assert f"trivial_env.py: error: {needle}" in capsys.readouterr().err


def test_a_failed_run_exits_1_with_its_last_traceback(capsys, monkeypatch):
    from atroposlib.envs.offline import ProcessFailedError

    async def failing_run(self):
        err = ProcessFailedError("10 items failed in a row")
        err.last_traceback = "Traceback: boom\n"
        raise err

    monkeypatch.setattr(TrivialEnv, "run_evaluate", failing_run)
    monkeypatch.setattr(sys, "argv", ["trivial_env.py"])
    with pytest.raises(SystemExit) as exc:
        run_cli(TrivialEnv, ["evaluate", "--testing", "true"])
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert "last failure:\nTraceback: boom\n" in err
    assert "trivial_env.py: error: 10 items failed in a row" in err
