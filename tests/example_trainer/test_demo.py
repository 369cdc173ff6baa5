"""The CPU demo measures generalisation: a fixed train / held-out split of the arithmetic
task, an eval that scores only held-out problems, and progress output (step N / total,
ETA, phases) that suits both a terminal and a log file."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import httpx
import pytest
import yaml

import environments.arithmetic_server as arith
from example_trainer.launch.evaluation import Evaluator
from example_trainer.launch.run_config import EvalSection, RunConfig
from example_trainer.launch.status import PlainProgress, eta_seconds, progress_text
from example_trainer.plugins import load_function

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "example_trainer" / "configs" / "demo_cpu.yaml"


def _problem(messages):
    a, b = messages[0]["content"].rstrip("=").split("+")
    return int(a), int(b)


def test_split_is_fixed_disjoint_and_covers_every_problem():
    train, held_out = arith.split_problems()
    assert len(held_out) == arith.EVAL_SIZE == 200
    assert not set(train) & set(held_out)
    assert sorted(train + held_out) == arith.all_problems()
    assert arith.split_problems() == (train, held_out)
    other_train, other_held_out = arith.split_problems(seed=arith.SPLIT_SEED + 1)
    assert other_held_out != held_out
    small_train, small_held_out = arith.split_problems(max_operand=3)
    assert len(small_held_out) == 8 and len(small_train) == 8  # at most half is held out


def test_warm_up_and_rollout_problems_never_come_from_the_held_out_set():
    _, held_out = arith.split_problems()
    held = set(held_out)
    warm = [_problem(m) for m, _ in arith.sft_examples(20000, seed=3)]
    assert not held & set(warm)
    rng = arith.random.Random(0)
    assert not held & {arith.sample_problem(rng) for _ in range(5000)}


def test_demo_eval_function_describes_a_held_out_set():
    cfg = yaml.safe_load(DEMO.read_text())
    fn = load_function(cfg["eval"]["function"])
    train, held_out = arith.split_problems()
    assert fn.eval_set["held_out"] is True
    assert fn.eval_set["size"] == len(held_out) and fn.eval_set["train_size"] == len(train)
    examples = load_function(cfg["warmup"]["examples"])(cfg["warmup"]["n_examples"], 0)
    assert not {_problem(m) for m, _ in examples} & set(held_out)


def test_answers_are_fixed_width_and_score_as_numbers():
    assert arith.problem_messages(7, 35) == [{"role": "user", "content": "07+35="}]
    assert arith.answer_text(7, 35) == "042" and arith.answer_text(99, 99) == "198"
    assert arith.score_completion(arith.answer_text(7, 35), 7, 35) == 1.0
    assert arith.answer_text(3, 4, max_operand=9) == "07"


def test_greedy_eval_scores_exactly_the_held_out_problems(tiny_model_dir, monkeypatch):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        choices = []
        for i, ids in enumerate(body["prompt"]):
            a, b = map(int, re.search(r"(\d+)\+(\d+)=", tok.decode(ids)).groups())
            seen.append((a, b))
            # Right on even a, wrong on odd a: the score must be that fraction.
            text = arith.answer_text(a, b) if a % 2 == 0 else "x"
            choices.append({"index": i, "text": text + "<|im_end|>"})
        return httpx.Response(200, json={"choices": choices})

    real = httpx.Client
    monkeypatch.setattr(
        arith.httpx, "Client", lambda **kw: real(transport=httpx.MockTransport(handler), **kw)
    )
    score = arith.greedy_eval("http://inference/v1", tok)
    _, held_out = arith.split_problems()
    assert sorted(seen) == held_out
    assert score == pytest.approx(sum(a % 2 == 0 for a, _ in held_out) / len(held_out))


def test_evaluator_records_the_eval_set_and_trials_per_score(tmp_path, tiny_model_dir):
    plugin = tmp_path / "plugin.py"
    plugin.write_text(
        "def score(url, tok):\n    return 0.25\n"
        "score.eval_set = {'held_out': True, 'size': 40, 'train_size': 60}\n"
    )
    ev = Evaluator(EvalSection(function=f"{plugin}:score"), "http://unused")
    assert ev.evaluate("before", 0, str(tiny_model_dir)) == 0.25
    assert ev.eval_set == {"held_out": True, "size": 40, "train_size": 60}
    assert ev.evals[0]["n"] == 40 and ev.evals[0]["label"] == "before"


def test_eta_is_the_pace_so_far_times_the_steps_left():
    assert eta_seconds(0, 200, 10.0) is None
    assert eta_seconds(50, 200, 100.0) == pytest.approx(300.0)
    assert eta_seconds(200, 200, 400.0) == 0.0
    # Paced from the first step seen (step 10, 80 s ago), not from the trainer's start.
    assert eta_seconds(50, 200, 80.0, since_step=10) == pytest.approx(300.0)
    assert eta_seconds(10, 200, 5.0, since_step=10) is None
    text = progress_text(
        50,
        200,
        300.0,
        {"warm-up": 61.0, "RL": 100.0, "eval": 7.0},
        {"train/loss": 0.01, "train/mean_score": 0.4},
        [{"label": "during", "step": 40, "score": 0.35}],
    )
    assert text.startswith("step 50 / 200  ETA 5m00s")
    assert "eval 0.350@40" in text and "(warm-up 1m01s, RL 1m40s, eval 7s)" in text


def test_plain_progress_prints_at_marks_and_on_a_timer_only_when_steps_advance():
    p = PlainProgress(total=200, marks=20, interval=30.0)  # a line per 10 steps
    assert p.due(1, 0.0)
    assert not p.due(1, 100.0)  # no new step
    assert not p.due(5, 1.0)
    assert p.due(10, 2.0)  # crossed a mark
    assert not p.due(12, 3.0)
    assert p.due(13, 40.0)  # 30 s since the last line


def test_without_a_terminal_the_launcher_prints_plain_progress_lines(tmp_path, capsys):
    from example_trainer.launch.launcher import Launcher

    cfg = RunConfig(
        run_dir=str(tmp_path / "run"), status_interval=0.05, trainer={"training_steps": 6}
    )
    launcher = Launcher(cfg)
    metrics = launcher.run_dir / "metrics.jsonl"
    script = (
        "import json, sys, time\n"
        "for s in range(1, 7):\n"
        "    with open(sys.argv[1], 'a') as f:\n"
        "        f.write(json.dumps({'step': s, 'train/loss': 0.1, 'train/mean_score': s / 10}) + '\\n')\n"
        "    time.sleep(0.3)\n"
    )
    launcher.rl_started = launcher.t0
    launcher.procs.start("trainer", [sys.executable, "-c", script, str(metrics)])
    try:
        assert launcher.monitor("unused") == 0  # pytest's stderr is not a terminal
    finally:
        launcher.shutdown()
    out = capsys.readouterr()
    lines = [line for line in out.out.splitlines() if line.startswith("step ")]
    assert lines and re.match(r"step 6 / 6  ETA (0s|\?)  loss \+0\.1000  reward 0\.600", lines[-1])
    assert all(re.match(r"step \d / 6  ETA \S+", line) for line in lines)
    assert "┃" not in out.out + out.err and "process" not in out.out + out.err


def test_launcher_run_dir_is_new_per_run_and_config_dir_links_to_it(tmp_path):
    from example_trainer.launch.launcher import Launcher

    cfg = RunConfig(run_dir=str(tmp_path / "demo"))
    first = Launcher(cfg).run_dir
    (first / "summary.md").write_text("first")
    second = Launcher(cfg).run_dir
    assert first != second and (first / "summary.md").read_text() == "first"
    assert (tmp_path / "demo").resolve() == second
    resumed = Launcher(RunConfig(run_dir=str(tmp_path / "demo"), trainer={"resume": True}))
    assert resumed.run_dir == second


def test_live_table_shows_each_process_and_the_progress_line(tmp_path):
    from rich.console import Console

    from example_trainer.launch.processes import ProcessGroup
    from example_trainer.launch.status import status_table

    procs = ProcessGroup(tmp_path)
    procs.start("trainer", [sys.executable, "-c", "pass"])
    procs.children["trainer"].proc.wait()
    line = progress_text(5, 10, 12.0, {"RL": 20.0}, {"train/loss": 0.5, "train/mean_score": 0.25})
    evals = [{"label": "before", "step": 0, "score": 0.2}]
    console = Console(record=True, width=200)
    console.print(status_table(tmp_path, procs, evals, 0.0, line))
    text = console.export_text()
    assert "trainer" in text and "done" in text and "logs/trainer.log" in text
    assert "step 5 / 10  ETA 12s" in text and "before@0=0.20" in text
