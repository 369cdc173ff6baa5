"""``benchmarks/vllm_demo.py``: the bar arithmetic, the report and one run read back from a
``summary.json`` written by a stand-in run command (no vLLM needed)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("vllm_demo", ROOT / "benchmarks" / "vllm_demo.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["vllm_demo"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    ("before", "after", "wall", "status", "learned", "bar"),
    [
        (0.19, 0.49, 800.0, "ok", True, True),  # exactly +0.3 and 2.58x
        (0.19, 0.368, 854.0, "ok", False, False),  # +0.178: short of +0.3
        (0.35, 0.66, 800.0, "ok", False, False),  # +0.31 but 1.9x
        (0.19, 0.60, 901.0, "ok", True, False),  # learned, but over 15 minutes
        (0.19, 0.60, 800.0, "failed (1)", True, False),
    ],
)
def test_bar_is_2x_and_plus_0_3_within_15_minutes(before, after, wall, status, learned, bar):
    m = _bench()
    run = m.DemoRun("d", status, before, after, wall)
    assert run.learned is learned
    assert run.meets_bar is bar


def test_report_names_each_run_with_its_load_and_the_medians():
    m = _bench()
    runs = [
        m.DemoRun("a", "ok", 0.19, 0.50, 700.0, load_mean=3.0, load_max=5.5),
        m.DemoRun("b", "ok", 0.19, 0.37, 854.0, load_mean=7.7, load_max=11.8),
        m.DemoRun("c", "no summary (exit 1)", None, None, 30.0, load_mean=2.0, load_max=2.0),
    ]
    text = m.report(runs)
    assert "| 2 | 0.190 | 0.370 | +0.180 | 1.95x | 854 s | 7.7 / 11.8 | no | no (ok) |" in text
    assert "| 3 | — | — | — | —x | 30 s | 2.0 / 2.0 | no | no (no summary (exit 1)) |" in text
    assert text.splitlines()[-1].startswith("1 of 3 runs meet the bar; after median 0.435")


def test_run_once_reads_the_summary_and_samples_the_load(tmp_path, monkeypatch):
    m = _bench()
    run_dir = tmp_path / "run"
    summary = {"status": "ok", "eval_before": 0.2, "eval_after": 0.55, "phases_s": {"rl": 3.5}}
    # A stand-in for example_trainer.run: writes the summary where --run-dir points.
    fake = tmp_path / "fake_run.py"
    fake.write_text(
        "import json, pathlib, sys\n"
        "d = pathlib.Path(sys.argv[sys.argv.index('--run-dir') + 1]); d.mkdir()\n"
        f"(d / 'summary.json').write_text(json.dumps({summary!r}))\n"
    )
    run = subprocess.run
    monkeypatch.setattr(
        subprocess,
        "call",
        lambda cmd, **kw: run([sys.executable, str(fake), *cmd[3:]], **kw).returncode,
    )
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model": "tiny"}))
    run = m.run_once(config, run_dir, tmp_path / "log", load_every=0.01)
    assert (run.before, run.after, run.status) == (0.2, 0.55, "ok")
    assert run.phases_s == {"rl": 3.5}
    assert run.load_max >= run.load_mean > 0
    assert run.meets_bar
    assert json.loads((run_dir / "summary.json").read_text())["eval_after"] == 0.55
