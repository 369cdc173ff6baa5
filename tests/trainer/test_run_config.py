"""atropos-grpo-run configuration: YAML + flags, bad input exits 2, helpers."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from example_trainer.run import (
    RunConfig,
    clear_previous_run,
    config_from_args,
    load_function,
    plot_curve,
)

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "example_trainer" / "configs" / "demo_cpu.yaml"


def test_demo_config_is_valid_and_uses_http_reload_on_arithmetic():
    cfg = config_from_args(["--config", str(DEMO)])
    assert cfg.weight_bridge_mode == "http_reload"
    assert cfg.envs == ["environments/arithmetic_server.py"]
    assert cfg.warmup is not None and cfg.eval is not None
    assert callable(load_function(cfg.warmup.examples)) and callable(
        load_function(cfg.eval.function)
    )


def test_flags_override_yaml_and_trainer_args_pass_through(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"model": "tiny", "trainer": {"lr": 0.01, "training_steps": 5}}))
    cfg = config_from_args(
        ["--config", str(path), "--training-steps", "7", "--no-warmup", "--", "--clip-eps", "0.1"]
    )
    assert cfg.trainer == {"lr": 0.01, "training_steps": 7}
    assert cfg.trainer_args == ["--clip-eps", "0.1"]
    assert cfg.warmup is None


@pytest.mark.parametrize(
    "argv, content, needle",
    [
        (["--bogus"], None, "--bogus"),
        ([], {"not_a_field": 1}, "not_a_field"),
        ([], {"trainer": {"lr": -1}}, "--lr"),
        (["--", "--no-such-trainer-flag"], None, "--no-such-trainer-flag"),
        ([], "- just\n- a list\n", "mapping"),
    ],
)
def test_bad_run_config_exits_2_with_reason(tmp_path, capsys, argv, content, needle):
    args = list(argv)
    if content is not None:
        path = tmp_path / "bad.yaml"
        path.write_text(content if isinstance(content, str) else yaml.safe_dump(content))
        args = ["--config", str(path), *args]
    with pytest.raises(SystemExit) as exc:
        config_from_args(args)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_load_function_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="file.py:function"):
        load_function("environments/arithmetic_server.py")
    with pytest.raises(FileNotFoundError):
        load_function("nope/missing.py:f")
    with pytest.raises(ValueError, match="no 'missing'"):
        load_function("environments/arithmetic_server.py:missing")


def test_plot_curve_and_clear_previous_run(tmp_path):
    rows = [{"step": i, "train/mean_score": i / 10} for i in range(1, 11)]
    plot_curve(rows, [{"step": 0, "score": 0.1, "label": "before"}], tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 1000
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "logs").mkdir()
    clear_previous_run(tmp_path)
    assert not (tmp_path / "curve.png").exists() and not (tmp_path / "logs").exists()


def test_run_config_fields_are_documented():
    assert all(f.description for f in RunConfig.model_fields.values())
