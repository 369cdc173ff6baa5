"""The coding environment in ``process`` and ``evaluate`` mode against a real
``atropos-serve-model`` (tiny offline model), with the real sandbox behind its scoring."""

from __future__ import annotations

import asyncio
import json

from atroposlib.envs.cli import build_env, parse_cli
from environments.code_execution_server import CodingEnv
from tests.environments.env_helpers import check_groups, process_argv


def test_process_writes_scored_groups_offline(serve_model, tmp_path):
    out = tmp_path / "coding.jsonl"
    argv = process_argv(serve_model, out, "--env.max_token_length", "24", group_size=2, steps=2)
    env = build_env(CodingEnv, parse_cli(CodingEnv, argv))
    asyncio.run(env.process_manager())
    groups = check_groups(out, 2, 2, -1.0, 1.0)
    for group in groups:
        assert set(group["scores"]) <= {-1.0, 1.0}
        prompt = group["messages"][0][0]["content"]
        assert prompt.startswith("Question: ") and "```python" in prompt
    assert env.executor.sandbox.bwrap  # scoring went through the sandbox executor


def test_evaluate_reports_pass_at_k(serve_model, tmp_path):
    argv = process_argv(serve_model, tmp_path / "unused.jsonl", "--env.max_token_length", "16")
    argv[0] = "evaluate"
    argv += [
        "--env.data_dir_to_save_evals",
        str(tmp_path / "evals"),
        "--env.eval_samples",
        "2",
        "--env.max_eval_items",
        "2",
        "--env.pass_at_k",
        "[1, 2]",
    ]
    env = build_env(CodingEnv, parse_cli(CodingEnv, argv))
    asyncio.run(env.run_evaluate())
    metrics = json.loads((tmp_path / "evals" / "metrics.json").read_text())["results"]["all"]
    for key in ("eval/pass_1", "eval/pass_at_1", "eval/pass_at_2", "eval/easy_pass_1"):
        assert 0.0 <= metrics[key] <= 1.0, (key, metrics)
    assert metrics["eval/failed_requests"] == 0.0
