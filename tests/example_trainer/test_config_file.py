"""Mistakes in an ``atropos-grpo-run --config`` file name the file and the key path (with a
"did you mean" from the helper the environment CLI uses), never a flag the user did not type;
a flag's mistake still names the flag."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from atroposlib.utils.suggest import closest, did_you_mean
from example_trainer.run import config_from_args


def _error(tmp_path: Path, capsys, content: object, *argv: str) -> tuple[str, str]:
    path = tmp_path / "run.yaml"
    path.write_text(content if isinstance(content, str) else yaml.safe_dump(content))
    with pytest.raises(SystemExit) as exc:
        config_from_args(["--config", str(path), *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err  # one line, no usage block
    return err, str(path)


def test_a_top_level_typo_names_the_file_and_suggests_the_key(tmp_path, capsys):
    err, path = _error(tmp_path, capsys, {"grup_size": 16})
    assert err == (
        f"atropos-grpo-run: error: {path}: grup_size: unknown key; did you mean group_size?"
    )


def test_a_nested_trainer_typo_is_a_key_path_not_a_flag(tmp_path, capsys):
    err, path = _error(tmp_path, capsys, {"trainer": {"trainig_steps": 5}})
    assert (
        f"{path}: trainer.trainig_steps: unknown key; did you mean trainer.training_steps?" in err
    )
    assert "--trainig-steps" not in err


def test_typos_in_sections_are_found_at_every_level(tmp_path, capsys):
    content = {
        "eval": {"function": "x.py:f", "evry_steps": 5},
        "warmup": {"examples": "x.py:g", "step": 3},
        "trainer": {"lr": 0.001, "bach_size": 8},
    }
    err, path = _error(tmp_path, capsys, content)
    assert f"{path}: eval.evry_steps: unknown key; did you mean eval.every_steps?" in err
    assert f"{path}: warmup.step: unknown key; did you mean warmup.steps?" in err
    assert f"{path}: trainer.bach_size: unknown key; did you mean trainer.batch_size?" in err


def test_a_key_nothing_resembles_points_to_help(tmp_path, capsys):
    err, _ = _error(tmp_path, capsys, {"zzzzqqq": 1})
    assert "zzzzqqq: unknown key (see --help)" in err


def test_bad_values_name_the_file_and_key_path(tmp_path, capsys):
    err, path = _error(tmp_path, capsys, {"group_size": 0})
    assert err.startswith(f"atropos-grpo-run: error: {path}: group_size: ")
    err, path = _error(tmp_path, capsys, {"trainer": {"lr": "fast"}})
    assert f"{path}: trainer.lr: " in err and "--lr" not in err
    err, path = _error(tmp_path, capsys, {"warmup": {"examples": "x.py:f", "steps": 0}})
    assert f"{path}: warmup.steps: " in err


def test_a_flag_overriding_the_file_is_named_as_the_flag(tmp_path, capsys):
    err, path = _error(tmp_path, capsys, {"group_size": 4}, "--group-size", "0")
    assert "--group-size: " in err and path not in err
    err, _ = _error(tmp_path, capsys, {"trainer": {"lr": 0.1}}, "--training-steps", "-3")
    assert "--training-steps: " in err


def test_unreadable_and_invalid_files(tmp_path, capsys):
    with pytest.raises(SystemExit):
        config_from_args(["--config", str(tmp_path / "missing.yaml")])
    assert "missing.yaml: cannot read the file" in capsys.readouterr().err
    err, _ = _error(tmp_path, capsys, "a: [1,\n")
    assert "invalid YAML" in err


def test_the_suggestion_helper_is_shared_with_the_env_cli():
    from atroposlib.envs import cli

    assert cli.closest is closest
    assert did_you_mean("grup_size", ["group_size", "model"]) == "; did you mean group_size?"
    assert did_you_mean("x", ["group_size"]) == ""
    assert did_you_mean("trainig_steps", ["training_steps"], prefix="trainer.") == (
        "; did you mean trainer.training_steps?"
    )
