"""The kebab-case CLI of atropos-grpo: defaults, flags, and bad-input exits."""

from __future__ import annotations

import subprocess
import sys

import pytest

from example_trainer.cli import build_parser, config_from_args
from example_trainer.config import TrainingConfig

SPEC_FLAGS = (
    "--model-name --lr --training-steps --batch-size --seq-len --gradient-accumulation-steps --warmup-steps "
    "--optimizer --device --save-path --checkpoint-interval --clip-eps --vllm-port --vllm-gpu "
    "--vllm-gpu-memory-utilization --max-model-len --dtype --vllm-restart-interval --atropos-url --use-wandb "
    "--wandb-project --wandb-group --weight-bridge-mode --vllm-config-path --train-layer-indices --lora-r "
    "--lora-alpha --lora-dropout --lora-target-modules --lora-layer-indices --trainer-rank --world-size "
    "--init-method --num-inference-nodes --debug-loading --benchmark --log-dir --kl-coef --resume"
).split()


def test_every_spec_flag_exists():
    opts = {o for a in build_parser()._actions for o in a.option_strings}
    missing = [f for f in SPEC_FLAGS if f not in opts]
    assert not missing


def test_defaults_match_original():
    c = config_from_args(["--model-name", "m"])
    assert (c.lr, c.training_steps, c.batch_size, c.seq_len, c.gradient_accumulation_steps) == (
        1e-5,
        10,
        2,
        2048,
        32,
    )
    assert (c.clip_eps, c.checkpoint_interval, c.warmup_steps, c.optimizer) == (
        0.2,
        3,
        0,
        "adamw_8bit",
    )
    assert (c.kl_coef, c.weight_bridge_mode, c.atropos_url, c.vllm_port) == (
        0.0,
        "none",
        "http://localhost:8000",
        9001,
    )
    assert c.lora_target_modules == ["q_proj", "v_proj"]
    assert c.api_batch_size == 64


def test_flags_are_parsed_into_config():
    c = config_from_args(
        [
            "--model-name",
            "m",
            "--lr",
            "3e-4",
            "--use-wandb",
            "--resume",
            "false",
            "--train-layer-indices",
            "0",
            "1",
            "--weight-bridge-mode",
            "http_reload",
            "--atropos-url",
            "http://127.0.0.1:1234/",
        ]
    )
    assert c.lr == 3e-4 and c.use_wandb is True and c.resume is False
    assert c.train_layer_indices == [0, 1]
    assert c.weight_bridge_mode == "http_reload"
    assert c.atropos_url == "http://127.0.0.1:1234"


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--model-name", "m", "--no-such-flag"], "--no-such-flag"),
        (["--lr", "1e-4"], "--model-name"),
        (["--model-name", "m", "--lr", "abc"], "--lr"),
        (["--model-name", "m", "--lr", "-1"], "--lr"),
        (["--model-name", "m", "--weight-bridge-mode", "telepathy"], "--weight-bridge-mode"),
        (["--model-name", "m", "--use-wandb", "maybe"], "--use-wandb"),
        (["--model-name", "m", "--training-steps", "0"], "--training-steps"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        config_from_args(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_console_entry_exits_2_on_unknown_flag():
    """``atropos-grpo``'s process smoke: the console module, in a process of its own."""
    proc = subprocess.run(
        [sys.executable, "-m", "example_trainer.grpo", "--model-name", "m", "--bogus"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "unrecognized arguments: --bogus" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_every_field_has_description():
    assert all(f.description for f in TrainingConfig.model_fields.values())


def test_every_field_is_declared_by_exactly_one_topic_group():
    """The argument groups come from the config's topics: a field declared on TrainingConfig
    itself (outside a topic) or in two topics would be missing from a group or listed twice."""
    from example_trainer.config_groups import GROUPS

    declared = [name for options in GROUPS for name in options.model_fields]
    assert sorted(declared) == sorted(TrainingConfig.model_fields)
    assert len(declared) == len(set(declared))
    assert list(TrainingConfig.model_fields) == declared  # --help and CONFIG.md follow GROUPS


def test_the_originals_groups_hold_the_originals_flags():
    """Each of the original's add_*_args adds its topic's group, which holds the original's
    flags of that group (and this trainer's additions on the same topic)."""
    import argparse

    from example_trainer import cli

    original = {
        cli.add_model_args: {"model_name", "dtype", "device"},
        cli.add_training_args: {"lr", "training_steps", "save_path", "checkpoint_interval"},
        cli.add_grpo_args: {"clip_eps"},
        cli.add_vllm_args: {"vllm_port", "vllm_gpu_memory_utilization", "max_model_len"},
        cli.add_atropos_args: {"atropos_url"},
        cli.add_wandb_args: {"use_wandb", "wandb_project", "wandb_group"},
        cli.add_mode_args: {"weight_bridge_mode", "train_layer_indices", "single_copy"},
        cli.add_lora_args: {"lora_r", "lora_alpha", "lora_dropout", "lora_target_modules"},
        cli.add_distributed_args: {"trainer_rank", "world_size", "init_method"},
        cli.add_debug_args: {"debug_loading", "benchmark"},
    }
    seen: set[str] = set()
    for add, names in original.items():
        parser = argparse.ArgumentParser()
        add(parser)
        dests = {a.dest for a in parser._actions} - {"help"}
        assert names <= dests, add.__name__
        assert not dests & seen, add.__name__
        seen |= dests
    assert seen == set(TrainingConfig.model_fields)


@pytest.mark.parametrize("name", ["./no-such-model", "~/no-such-model-dir", "../nope"])
def test_model_name_spelled_as_a_missing_path_is_refused(name, capsys):
    with pytest.raises(SystemExit) as exc:
        config_from_args(["--model-name", name])
    assert exc.value.code == 2
    assert f"{name} does not exist" in capsys.readouterr().err


@pytest.fixture
def grpo_main(monkeypatch):
    """``atropos-grpo``'s ``main`` (the console entry), callable in-process: the signal and
    parent-death supervision it installs first belongs to a process of its own, not this one."""
    from example_trainer import grpo

    monkeypatch.setattr(grpo.supervision, "install", lambda *a, **k: None)
    return grpo.main


def test_missing_model_path_exits_2_with_one_line(grpo_main, capsys):
    with pytest.raises(SystemExit) as exc:
        grpo_main(["--model-name", "/does/not/exist"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "/does/not/exist does not exist" in lines[0], err


def test_unresolvable_hub_name_offline_exits_2_with_one_line(
    grpo_main, tmp_path, capsys, monkeypatch
):
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # an empty cache
    verbosity = huggingface_hub.logging.get_verbosity()
    try:
        code = grpo_main(["--model-name", "someorg/no-such-model"])
    finally:
        huggingface_hub.logging.set_verbosity(verbosity)
    assert code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "someorg/no-such-model" in lines[0] and "HF_HUB_OFFLINE=1" in lines[0]
