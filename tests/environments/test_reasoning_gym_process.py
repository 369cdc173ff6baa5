"""``ReasoningGymEnv`` against a real ``atropos-serve-model`` (tiny offline model): every
installed task makes a valid group in ``process`` mode (one run cycling through all tasks),
and ``evaluate`` writes per-task accuracy to ``metrics.json``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

pytest.importorskip("reasoning_gym")

from atroposlib.envs.adapters import _rg_worker  # noqa: E402
from atroposlib.envs.adapters.reasoning_gym import ReasoningGymEnv  # noqa: E402
from atroposlib.envs.cli import build_env, parse_cli  # noqa: E402
from tests.environments.env_helpers import check_groups, process_argv  # noqa: E402

TASKS = _rg_worker.task_names()
SEED = 3


@pytest.fixture(scope="module")
def all_task_groups(serve_model, tmp_path_factory) -> Dict[str, List[Dict[str, Any]]]:
    """One process-mode run over every task (round robin, one group each): groups by task."""
    out = tmp_path_factory.mktemp("rg") / "groups.jsonl"
    argv = process_argv(serve_model, out, group_size=2, steps=len(TASKS))
    argv += [
        "--env.tasks",
        "all",
        "--env.order",
        "round_robin",
        "--env.seed",
        str(SEED),
        "--env.max_answer_tokens",
        "6",
        "--env.max_token_length",
        "32768",
        "--env.dataset_size",
        "10",
        "--env.max_num_workers",
        "16",
        # Excluding eval questions makes each task's eval items first (tested on its own
        # in test_reasoning_gym_demo.py); here it would double the generation time.
        "--env.exclude_eval_questions",
        "false",
    ]
    env = build_env(ReasoningGymEnv, parse_cli(ReasoningGymEnv, argv))
    question_to_task: Dict[str, str] = {}
    next_item = env.get_next_item

    async def recording_next_item() -> Dict[str, Any]:
        item = await next_item()
        question_to_task[item["entry"]["question"]] = item["task"]
        return item

    env.get_next_item = recording_next_item  # type: ignore[method-assign]
    asyncio.run(env.process_manager())
    assert sorted(question_to_task.values()) == TASKS, "round robin visits every task once"
    groups = check_groups(out, 2, len(TASKS), 0.0, 1.0)
    by_task: Dict[str, List[Dict[str, Any]]] = {}
    for group in groups:
        question = group["messages"][0][-2]["content"]
        by_task.setdefault(question_to_task.get(question, "?"), []).append(group)
    return by_task


@pytest.mark.parametrize("task", TASKS)
def test_every_task_makes_a_valid_group_in_process_mode(all_task_groups, task):
    groups = all_task_groups.get(task)
    assert groups, f"{task}: no group written (unmapped: {len(all_task_groups.get('?', []))})"
    for group in groups:
        for messages in group["messages"]:
            assert [m["role"] for m in messages] == ["system", "user", "assistant"]
        assert all(0.0 <= s <= 1.0 for s in group["scores"])


def test_evaluate_reports_accuracy_per_task(serve_model, tmp_path):
    tasks = ["chain_sum", "leg_counting", "prime_factorization"]
    argv = process_argv(serve_model, tmp_path / "unused.jsonl")
    argv[0] = "evaluate"
    argv += [
        "--env.data_dir_to_save_evals",
        str(tmp_path / "evals"),
        "--env.tasks",
        json.dumps(tasks),
        "--env.eval_items_per_task",
        "2",
        "--env.max_answer_tokens",
        "8",
    ]
    env = build_env(ReasoningGymEnv, parse_cli(ReasoningGymEnv, argv))
    asyncio.run(env.run_evaluate())
    metrics = json.loads((tmp_path / "evals" / "metrics.json").read_text())["results"]["all"]
    for task in tasks:
        assert 0.0 <= metrics[f"eval/{task}/accuracy"] <= 1.0, metrics
    assert metrics["eval/failed_requests"] == 0.0
    samples = [
        json.loads(line)
        for path in Path(tmp_path / "evals").glob("samples*.jsonl")
        for line in path.read_text().splitlines()
    ]
    assert sorted(s["task"] for s in samples) == sorted(tasks * 2)
