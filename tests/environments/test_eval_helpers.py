"""``run_eval_set`` / ``drain_metrics``: the evaluation and logging code every environment shares."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from atroposlib.envs import files
from atroposlib.envs.eval_helpers import drain_metrics, mean_of, means_by, run_eval_set

ENV_FILES = [
    "arithmetic_server.py",
    "blackjack_server.py",
    "gsm8k_server.py",
    "mcqa_thinking_env.py",
    "rlaif_server.py",
    "tool_calling_server.py",
    "tool_use_multiturn_server.py",
    "dataset_environment/dataset_env.py",
]
ROOT = Path(__file__).resolve().parents[2]


class RecordingEnv:
    """Just what ``run_eval_set`` touches: ``config.max_eval_workers``, ``name`` and an
    ``evaluate_log`` that writes through the same ``envs.files`` helpers as BaseEnv."""

    name = "recording"

    def __init__(self, out_dir: Path, workers: int) -> None:
        self.config = SimpleNamespace(max_eval_workers=workers)
        self.out_dir = out_dir
        self.logged: list[dict] = []

    async def evaluate_log(self, metrics, task_name=None, samples=None, **kw) -> None:
        self.logged.append({"metrics": metrics, "task_name": task_name, "samples": samples, **kw})
        doc = files.eval_metrics_document(metrics, task_name or "t", "m", 0.0, {})
        files.write_eval_results(str(self.out_dir), doc, samples)


def test_run_eval_set_bounds_concurrency_counts_failures_and_writes_results(tmp_path):
    env = RecordingEnv(tmp_path, workers=3)
    running = 0
    peak = 0

    async def one(i: int):
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1
        if i == 4:
            raise RuntimeError("server went away")
        return {"messages": [{"role": "user", "content": str(i)}], "correct": i % 2 == 0}

    metrics = asyncio.run(run_eval_set(env, range(10), one, generation_parameters={"t": 0}))
    assert peak == 3
    # items 0..9 without 4: correct are 0, 2, 6, 8 → 4 of 9
    assert metrics == {"eval/percent_correct": pytest.approx(4 / 9), "eval/failed_requests": 1.0}
    (logged,) = env.logged
    assert len(logged["samples"]) == 9 and logged["generation_parameters"] == {"t": 0}
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert written["results"]["all"]["eval/percent_correct"] == pytest.approx(4 / 9)
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == 9


def test_run_eval_set_custom_metric_extra_metrics_and_concurrency(tmp_path):
    env = RecordingEnv(tmp_path, workers=1)

    async def one(score):
        return {"score": score, "outcome": "win" if score and score > 0 else "loss"}

    metrics = asyncio.run(
        run_eval_set(
            env,
            [1.0, -1.0, None, 0.5],
            one,
            metric="eval/mean_reward",
            value="score",
            failed_metric="eval/failed_games",
            extra_metrics=lambda s: {
                "eval/win_rate": sum(x["outcome"] == "win" for x in s) / len(s)
            },
            concurrency=4,
            task_name="games",
        )
    )
    assert metrics["eval/mean_reward"] == pytest.approx(0.5 / 3)  # None is not averaged
    assert mean_of([{"score": True}, {"score": False}, {}], "score") == 0.5
    assert metrics["eval/win_rate"] == 0.5 and metrics["eval/failed_games"] == 0.0
    assert env.logged[0]["task_name"] == "games"


def test_drain_metrics_reports_means_once_and_empties_buffers():
    buffer = [1.0, 0.0, 1.0, 0.0]
    empty: list[float] = []
    evals = {"eval/percent_correct": 0.25}
    metrics = drain_metrics(
        {"step": 3}, evals, train={"train/percent_correct": buffer, "train/other": empty}
    )
    assert metrics == {"step": 3, "train/percent_correct": 0.5, "eval/percent_correct": 0.25}
    assert buffer == [] and evals == {}
    assert drain_metrics(None, evals, train={"train/percent_correct": buffer}) == {}


SAMPLES = [
    {"task": "b", "score": 1.0, "correct": True},
    {"task": "a", "score": 0.5, "correct": False},
    {"task": "b", "score": 0.0, "correct": False},
]


def test_means_by_averages_each_field_per_group_in_sorted_order():
    metrics = means_by(SAMPLES, "task", {"accuracy": "correct", "mean_score": "score"})
    assert metrics == {
        "eval/a/accuracy": 0.0,
        "eval/a/mean_score": 0.5,
        "eval/b/accuracy": 0.5,
        "eval/b/mean_score": 0.5,
    }
    assert list(metrics)[:2] == ["eval/a/accuracy", "eval/a/mean_score"]


def test_means_by_follows_the_given_order_and_skips_groups_without_samples():
    metrics = means_by(SAMPLES, "task", {"acc": "correct"}, order=["b", "absent"], prefix="x")
    assert metrics == {"x/b/acc": 0.5}  # "a" is not in the order, "absent" has no sample
    assert means_by([], "task", {"acc": "correct"}) == {}


@pytest.mark.parametrize("name", ENV_FILES)
def test_every_environment_uses_the_shared_helpers(name):
    source = (ROOT / "environments" / name).read_text()
    assert "run_eval_set(" in source, f"{name} has its own eval loop"
    assert "drain_metrics(" in source, f"{name} has its own wandb_log bookkeeping"
    assert "asyncio.Semaphore" not in source


def test_scored_group_lines_up_rollouts_and_scores():
    from atroposlib.envs.rollout_helpers import scored_group

    rollouts = [
        {
            "tokens": [1, 2, 3],
            "masks": [-100, 2, 3],
            "logprobs": [1.0, -0.1, -0.2],
            "messages": [{"role": "assistant", "content": "a"}],
            "text": "a",
        },
        {
            "tokens": [1, 4],
            "masks": [-100, 4],
            "logprobs": [1.0, -0.3],
            "messages": [{"role": "assistant", "content": "b"}],
            "text": "b",
        },
    ]
    group = scored_group(rollouts, [1, -1])
    assert group["tokens"] == [[1, 2, 3], [1, 4]] and group["masks"][1] == [-100, 4]
    assert group["inference_logprobs"][0] == [1.0, -0.1, -0.2]
    assert group["scores"] == [1.0, -1.0] and group["messages"][1][0]["content"] == "b"
    with pytest.raises(ValueError, match="1 scores for 2 rollouts"):
        scored_group(rollouts, [1.0])
