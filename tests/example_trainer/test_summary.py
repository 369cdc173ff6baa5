"""The run's summary: Wilson intervals, "after" as a mean of the last evals, the eval-set
record, printed paths, and a run directory per run behind a ``latest`` link."""

from __future__ import annotations

import json
import math
import os

import pytest

from example_trainer.launch.summary import (
    after_score,
    format_seconds,
    new_run_dir,
    resumed_run_dir,
    wilson_interval,
    write_summary,
)


@pytest.mark.parametrize("score, n", [(0.5, 200), (0.1, 200), (0.93, 50), (0.3, 10)])
def test_wilson_bounds_solve_the_score_equation(score, n):
    # Wilson's interval is the set of p with |score - p| <= z * sqrt(p (1 - p) / n).
    z = 1.96
    lo, hi = wilson_interval(score, n)
    assert lo < score < hi
    for p in (lo, hi):
        assert (score - p) ** 2 == pytest.approx(z * z * p * (1 - p) / n, rel=1e-9)


def test_wilson_stays_in_range_and_is_not_degenerate_at_the_edges():
    lo, hi = wilson_interval(0.0, 200)
    assert lo == 0.0 and 0.0 < hi < 0.05
    lo, hi = wilson_interval(1.0, 200)
    assert 0.95 < lo < 1.0 and hi == 1.0
    assert wilson_interval(0.5, 0) == (0.0, 1.0)
    wide, narrow = wilson_interval(0.5, 50), wilson_interval(0.5, 800)
    assert narrow[1] - narrow[0] < wide[1] - wide[0]


def _evals(scores):
    out = [{"label": "before", "step": 0, "score": scores[0], "n": 200}]
    for i, s in enumerate(scores[1:-1], start=1):
        out.append({"label": "during", "step": 20 * i, "score": s, "n": 200})
    out.append({"label": "after", "step": 20 * (len(scores) - 1), "score": scores[-1], "n": 200})
    return out


def test_after_is_the_mean_of_the_last_three_evals_and_never_includes_before():
    evals = _evals([0.1, 0.2, 0.7, 0.4, 0.6])
    after, points = after_score(evals)
    assert after == pytest.approx((0.7 + 0.4 + 0.6) / 3)
    assert [p["step"] for p in points] == [40, 60, 80]
    after, points = after_score(_evals([0.1, 0.5]))
    assert after == 0.5 and len(points) == 1
    assert after_score(_evals([0.1])[:1]) == (None, [])


def test_format_seconds():
    assert format_seconds(42.3) == "42s"
    assert format_seconds(75) == "1m15s"
    assert format_seconds(600) == "10m00s"


def test_summary_records_eval_set_intervals_phases_and_prints_where_results_are(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text(
        "\n".join(json.dumps({"step": s, "train/mean_score": s / 100}) for s in range(1, 81))
    )
    evals = _evals([0.1, 0.2, 0.5, 0.4, 0.6])
    eval_set = {"held_out": True, "size": 200, "train_size": 9800}
    summary = write_summary(
        tmp_path,
        0,
        evals,
        started=0.0,
        inference_version=80,
        eval_set=eval_set,
        phases={"warm-up": 30.0, "RL": 100.0, "eval": 12.0},
        total_steps=80,
    )
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["eval_set"] == eval_set
    assert saved["eval_before"] == 0.1
    assert saved["eval_after"] == pytest.approx(0.5)
    assert saved["eval_after_steps"] == [40, 60, 80]
    assert saved["learned"] is True and summary["learned"] is True
    assert saved["phases_s"] == {"warm-up": 30.0, "RL": 100.0, "eval": 12.0}
    for e in saved["evals"]:
        assert e["ci95"] == pytest.approx(list(wilson_interval(e["score"], 200)))
    md = (tmp_path / "summary.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ") and "step" not in line]
    assert len(rows) == len(evals)
    lo, hi = wilson_interval(0.5, 200)
    assert f"| during | 40 | 0.500 | {lo:.3f} – {hi:.3f} | 200 |" in md
    assert "held out from training (train set: 9800)" in md
    assert "80 / 80" in md
    assert "(warm-up 30s, RL 1m40s, eval 12s; evals during RL overlap it)" in md
    out = capsys.readouterr().out
    assert f"curve:   {tmp_path / 'curve.png'}" in out
    assert f"summary: {tmp_path / 'summary.md'}" in out
    assert "0.100 before → 0.500 after" in out
    assert (tmp_path / "curve.png").stat().st_size > 1000


def test_summary_without_improvement_says_not_learned(tmp_path, capsys):
    summary = write_summary(tmp_path, 0, _evals([0.3, 0.3, 0.35, 0.4, 0.4]), 0.0, None)
    assert summary["learned"] is False
    assert "learned (after >= 2x before and >= +0.3): no" in (tmp_path / "summary.md").read_text()


def test_each_run_gets_its_own_directory_and_the_link_names_the_latest(tmp_path):
    link = tmp_path / "runs" / "demo"
    first = new_run_dir(link, "20260101-000000")
    (first / "summary.md").write_text("first")
    second = new_run_dir(link, "20260101-000000")  # same second: still a new directory
    assert first != second and first.parent == second.parent == link.parent
    assert (first / "summary.md").read_text() == "first"
    assert link.is_symlink() and link.resolve() == second.resolve()
    assert not os.path.isabs(os.readlink(link))  # the runs folder can be moved whole
    assert resumed_run_dir(link) == second.resolve()


def test_an_old_real_run_directory_is_kept_not_overwritten(tmp_path):
    link = tmp_path / "demo"
    link.mkdir()
    (link / "summary.md").write_text("old run")
    new = new_run_dir(link, "20260101-000000")
    kept = [p for p in tmp_path.iterdir() if p.is_dir() and not p.is_symlink() and p != new]
    assert len(kept) == 1 and (kept[0] / "summary.md").read_text() == "old run"
    assert link.is_symlink() and link.resolve() == new.resolve()
    assert not any(new.iterdir())


def test_wilson_interval_matches_a_direct_search():
    # Independent check: scan p on a fine grid for the set where the score test accepts.
    score, n, z = 0.37, 120, 1.96
    accepted = [
        p / 10000
        for p in range(1, 10000)
        if abs(score - p / 10000) <= z * math.sqrt((p / 10000) * (1 - p / 10000) / n)
    ]
    lo, hi = wilson_interval(score, n)
    assert accepted[0] == pytest.approx(lo, abs=2e-4)
    assert accepted[-1] == pytest.approx(hi, abs=2e-4)
