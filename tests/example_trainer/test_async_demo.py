"""The async-RL knobs of ``atropos-grpo-run`` (run-api's --max-staleness from the run
config) and ``benchmarks/async_demo.py``'s command line and bar arithmetic."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

from example_trainer.launch.launcher import Launcher
from example_trainer.run import config_from_args

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location(
        "async_demo", ROOT / "benchmarks" / "async_demo.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["async_demo"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_max_staleness_and_api_args_reach_the_run_api_command(tmp_path):
    cfg = config_from_args(["--run-dir", str(tmp_path / "a"), "--max-staleness", "1"])
    cmd = Launcher(cfg).api_cmd()
    assert cmd[1:3] == ["-m", "atroposlib.cli.run_api"]
    assert cmd[cmd.index("--max-staleness") + 1] == "1"
    path = tmp_path / "r.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "run_dir": str(tmp_path / "b"),
                "max_staleness": 0,
                "api_args": ["--log-level", "warning"],
            }
        )
    )
    cmd = Launcher(config_from_args(["--config", str(path)])).api_cmd()
    assert cmd[-4:] == ["--max-staleness", "0", "--log-level", "warning"]


def test_without_max_staleness_run_api_gets_no_flag(tmp_path):
    cmd = Launcher(config_from_args(["--run-dir", str(tmp_path / "a")])).api_cmd()
    assert "--max-staleness" not in cmd


def test_negative_max_staleness_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        config_from_args(["--max-staleness", "-1"])
    assert exc.value.code == 2
    assert "--max-staleness" in capsys.readouterr().err


def test_bench_command_passes_staleness_to_the_launcher_and_correction_to_the_trainer(tmp_path):
    bench = _bench()
    cmd = bench.demo_command(bench.DEMO, tmp_path / "r", 1, "tis", 1.5)
    i = cmd.index("--")
    assert cmd[cmd.index("--max-staleness") + 1] == "1" and cmd.index("--max-staleness") < i
    assert cmd[i + 1 :] == ["--off-policy-correction", "tis", "--off-policy-clip", "1.5"]
    cfg = config_from_args(cmd[3:])  # what atropos-grpo-run makes of it
    assert cfg.max_staleness == 1
    assert cfg.trainer_args == ["--off-policy-correction", "tis", "--off-policy-clip", "1.5"]
    assert "--" not in bench.demo_command(bench.DEMO, tmp_path / "r", None, None, None)


@pytest.mark.parametrize(
    "before, after, wall, ok",
    [
        (0.185, 0.548, 130.0, True),
        (0.185, 0.468, 130.0, False),  # +0.283: under +0.3
        (0.35, 0.66, 130.0, False),  # +0.31 but under 2x
        (0.185, 0.6, 601.0, False),  # over 10 minutes
    ],
)
def test_bench_bar_is_2x_and_plus_0_3_within_10_minutes(before, after, wall, ok):
    bench = _bench()
    summary = {"status": "ok", "eval_before": before, "eval_after": after, "run_dir": "d"}
    assert bench.result_from_summary(summary, wall).meets_bar is ok


def test_bench_reports_summaries_with_median_and_range(tmp_path, capsys):
    bench = _bench()
    paths = []
    for i, after in enumerate([0.5, 0.6, 0.3]):
        p = tmp_path / f"s{i}.json"
        p.write_text(
            json.dumps(
                {"status": "ok", "eval_before": 0.2, "eval_after": after, "wall_time_s": 100.0}
            )
        )
        paths.append(str(p))
    assert bench.main(["--summaries", *paths]) == 0
    out = capsys.readouterr().out
    assert "2 of 3 runs meet the bar" in out
    assert "gain median +0.300 (+0.100 to +0.400)" in out


def test_min_gain_sets_the_reasoning_gym_demos_bar(tmp_path, capsys):
    bench = _bench()
    # 0.205 -> 0.442: 2.16x and +0.237 meets reasoning-gym's +0.2, not the arithmetic demo's +0.3
    summary = {"status": "ok", "eval_before": 0.205, "eval_after": 0.442, "wall_time_s": 385.0}
    assert bench.result_from_summary(summary).meets_bar is False
    assert bench.result_from_summary(summary, min_gain=0.2).meets_bar is True
    # +0.172 stays under it
    low = {**summary, "eval_after": 0.377}
    assert bench.result_from_summary(low, min_gain=0.2).meets_bar is False
    paths = []
    for i, s in enumerate([summary, low]):
        p = tmp_path / f"s{i}.json"
        p.write_text(json.dumps(s))
        paths.append(str(p))
    assert bench.main(["--summaries", *paths, "--min-gain", "0.2"]) == 0
    assert "1 of 2 runs meet the bar" in capsys.readouterr().out
