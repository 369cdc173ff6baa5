"""``max_wall_time``: one-time work is not counted, and a run that reaches the limit ends the
trainer after its step with a final model, exits 124 and says why (summary line and
``summary.md``).

The trainer side runs the real ``GRPOTrainer`` loop against a real ``run-api``; the launcher
side watches a real child process that plays the trainer's part of the contract (it steps,
and on the stop file saves ``final_model`` and exits 0, as ``GRPOTrainer`` does).
"""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

import httpx

from atroposlib.testing.launch import run_api_cmd
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import running_process
from example_trainer import api, trainers
from example_trainer.launch.launcher import STOP_GRACE, Launcher
from example_trainer.launch.run_config import RunConfig
from example_trainer.launch.summary import TIME_LIMIT_EXIT, write_summary
from example_trainer.trainers import GRPOTrainer
from example_trainer.weight_sync import WeightSync
from tests.example_trainer.conftest import cpu_config, make_batch


def test_trainer_ends_at_the_stop_file_and_saves_final_model(
    tiny_model_dir, tiny_tokenizer, tmp_path, monkeypatch
):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    groups = make_batch(tiny_tokenizer, n_groups=8, group_size=2, seed=3)
    real_register = api.register_trainer

    def register_then_queue(config, starting_step=0, **kwargs):
        answer = real_register(config, starting_step, **kwargs)
        for g in groups:
            assert httpx.post(f"{url}/scored_data", json=g, timeout=10).status_code == 200
        return answer

    monkeypatch.setattr(api, "register_trainer", register_then_queue)
    monkeypatch.setattr(trainers, "make_weight_sync", lambda c, m, t: WeightSync(c, m, t))
    stop = tmp_path / "stop-requested"
    cfg = cpu_config(
        tiny_model_dir, tmp_path, atropos_url=url, training_steps=4, batch_size=4,
        batch_poll_interval=0.05, stop_file=str(stop), checkpoint_interval=0,
    )  # fmt: skip
    with running_process(
        run_api_cmd(port, "--log-level", "warning"), health_url=f"{url}/health", timeout=60
    ):
        trainer = GRPOTrainer(cfg)
        run = trainer.update.run

        def stop_after_two(*args, **kwargs):
            out = run(*args, **kwargs)
            if trainer.step + 1 == 2:  # the launcher's limit, reached during step 2
                stop.touch()
            return out

        trainer.update.run = stop_after_two
        final = trainer.train()
    assert trainer.step == 2
    assert final is not None and (final / "config.json").exists()
    assert final.name == "final_model"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


FAKE_TRAINER = textwrap.dedent(
    """
    import json, os, sys, time
    run_dir, stop, steps, pause = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    save = os.path.join(run_dir, "checkpoints")
    os.makedirs(os.path.join(save, "step_1"), exist_ok=True)
    for step in range(1, steps + 1):
        if os.path.exists(stop):
            break
        with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "train/loss": 0.1 * step, "train/mean_score": 0.5,
                                "train/entropy": 2.0, "train/kl": 0.01}) + "\\n")
        time.sleep(pause)
    os.makedirs(os.path.join(save, "final_model"), exist_ok=True)
    """
)


def _launcher(tmp_path: Path, max_wall_time: float, steps: int = 1000, **trainer) -> Launcher:
    cfg = RunConfig(
        run_dir=str(tmp_path / "run"),
        max_wall_time=max_wall_time,
        status_interval=0.05,
        trainer={"training_steps": steps, "lr": 0.001, **trainer},
        group_size=4,
    )
    return Launcher(cfg)


def _start_fake_trainer(launcher: Launcher, tmp_path: Path, steps: int, pause: float) -> None:
    script = tmp_path / "fake_trainer.py"
    script.write_text(FAKE_TRAINER)
    cmd = [sys.executable, str(script), str(launcher.run_dir), str(launcher.stop_file)]
    launcher.procs.start("trainer", [*cmd, str(steps), str(pause)])


def test_the_limit_stops_the_trainer_cleanly_exits_124_and_says_why(tmp_path, capsys):
    launcher = _launcher(tmp_path, max_wall_time=1.0)
    # One-time work (the first run's warm-up) is not counted: 100 s of it has passed already.
    launcher.prepare_seconds = 100.0
    launcher.t0 -= 100.0
    _start_fake_trainer(launcher, tmp_path, steps=1000, pause=0.05)
    try:
        t = time.time()
        status = launcher.monitor("m", interactive=False)
        assert time.time() - t < STOP_GRACE
    finally:
        launcher.shutdown()
    assert status == TIME_LIMIT_EXIT
    assert launcher.stop_file.exists()
    assert "max_wall_time (1s, one-time work not counted) reached" in launcher.stop_reason
    assert "the trainer saved final_model" in launcher.stop_reason
    record = launcher.record("m")
    assert record["final_model"].endswith("checkpoints/final_model")
    assert [Path(c).name for c in record["checkpoints"]] == ["step_1"]
    assert record["hyperparameters"]["lr"] == 0.001 and record["hyperparameters"]["group_size"] == 4
    summary = write_summary(launcher.run_dir, status, [], launcher.t0, None, record=record)
    assert summary["status"] == "stopped at max_wall_time" and summary["exit_status"] == 124
    md = (launcher.run_dir / "summary.md").read_text()
    assert md.startswith("# Run summary (stopped at max_wall_time)")
    assert "- stopped because: max_wall_time" in md
    assert "- final model: " + record["final_model"] in md
    assert "| lr | 0.001 |" in md and "```yaml" in md and "max_wall_time: 1.0" in md
    out = capsys.readouterr().out
    assert "run stopped at max_wall_time" in out and "stopped because: max_wall_time" in out


def test_a_run_within_the_limit_trains_all_steps(tmp_path):
    first = _launcher(tmp_path, max_wall_time=60.0, steps=3)
    first.stop_file.touch()  # that run stopped at its limit; this one resumes in its directory
    launcher = _launcher(tmp_path, max_wall_time=60.0, steps=3, resume=True)
    assert launcher.run_dir == first.run_dir and not launcher.stop_file.exists()
    _start_fake_trainer(launcher, tmp_path, steps=3, pause=0.01)
    try:
        status = launcher.monitor("m", interactive=False)
    finally:
        launcher.shutdown()
    assert status == 0
    assert launcher.stop_reason == "trained all 3 of 3 steps"


def test_one_time_work_is_not_counted(tmp_path):
    launcher = _launcher(tmp_path, max_wall_time=10.0)
    launcher.t0 -= 50.0
    assert launcher.counted_seconds() >= 50.0
    launcher.prepare_seconds = 30.0
    launcher.phases["teacher"] = 15.0
    assert 5.0 <= launcher.counted_seconds() < 6.0


def test_curve_has_a_loss_entropy_kl_panel(tmp_path, monkeypatch):
    import matplotlib.figure

    from example_trainer.launch.summary import LOSS_PANEL, plot_curve

    titles = []
    real = matplotlib.figure.Figure.savefig

    def record_titles(fig, *args, **kwargs):
        titles.extend(ax.get_title() for ax in fig.axes)
        texts = [t.get_text() for ax in fig.axes for t in ax.texts]
        titles.extend(texts)
        return real(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record_titles)
    rows = [{"step": s, "train/mean_score": 0.1 * s, "train/loss": 0.5 / s, "train/kl": 0.01 * s}
            for s in range(1, 6)]  # fmt: skip
    plot_curve(rows, [], tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 0
    assert [t for _, t in LOSS_PANEL] == ["loss", "entropy", "KL to reference"]
    assert {"loss", "entropy", "KL to reference"} <= set(titles)
    assert "not logged" in titles  # no train/entropy in these rows: the panel says so
