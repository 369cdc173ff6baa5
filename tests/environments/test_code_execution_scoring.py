"""The coding environment's scoring in the real sandbox: the shipped problem set's reference
solutions pass, wrong, crashing, slow and hostile answers fail, and the harness's verdicts
cannot be forged from inside."""

from __future__ import annotations

import asyncio

import pytest

from atroposlib.sandbox import Sandbox, SandboxConfig
from environments.code_execution_problems import EVAL_NAMES, PROBLEMS, problem_set
from environments.code_execution_scoring import (
    SandboxExecutor,
    extract_python_code_blocks,
    outputs_match,
    values_match,
)
from tests.environments.env_helpers import process_argv


@pytest.fixture(scope="module")
def executor() -> SandboxExecutor:
    return SandboxExecutor(Sandbox(SandboxConfig(timeout_s=4)), per_test_timeout_s=2.0)


def test_the_problem_set_is_fixed_and_split():
    train, test = problem_set()
    again_train, again_test = problem_set()
    assert train == again_train and test == again_test  # same seed, same tests everywhere
    assert {t["name"] for t in test} == set(EVAL_NAMES)
    assert not {t["name"] for t in train} & set(EVAL_NAMES)
    kinds = {(t["problem_type"], t["split"]) for t in train + test}
    assert kinds == {(k, s) for k in ("func", "stdin_stdout") for s in ("train", "test")}
    assert len(train) + len(test) == len(PROBLEMS)
    for item in train + test:
        assert len(item["tests"]["input"]) == len(item["tests"]["output"]) == 6


async def test_every_reference_solution_passes_in_the_sandbox(executor):
    train, test = problem_set()
    items = train + test
    reports = await asyncio.gather(*(executor.run(i["solution"], i) for i in items))
    failed = {i["name"]: r.detail for i, r in zip(items, reports, strict=True) if not r.all_passed}
    assert failed == {}


async def test_wrong_crashing_and_slow_answers_fail_with_their_reason(executor):
    train, _ = problem_set()
    by_name = {i["name"]: i for i in train}
    squares, sums = by_name["sum_of_squares"], by_name["sum_pairs"]
    wrong = "class Solution:\n    def sumOfSquares(self, nums):\n        return sum(nums)\n"
    crash = "class Solution:\n    def sumOfSquares(self, nums):\n        return 1 / 0\n"
    slow = "class Solution:\n    def sumOfSquares(self, nums):\n        while True: pass\n"
    stdin_wrong = "t = int(input())\nfor _ in range(t):\n    print(0)\n"
    reports = await asyncio.gather(
        executor.run(wrong, squares),
        executor.run(crash, squares),
        executor.run(slow, squares),
        executor.run(stdin_wrong, sums),
        executor.run("import sys; sys.exit(3)", sums),
    )
    assert [r.all_passed for r in reports] == [False] * 5
    assert reports[0].detail == "Wrong Answer" or not all(reports[0].passed)
    assert reports[1].detail.startswith("Runtime Error: ZeroDivisionError")
    assert reports[2].detail.startswith(("Time Limit Exceeded", "sandbox:"))
    assert reports[3].detail == "Wrong Answer"
    assert reports[4].detail.startswith("Runtime Error")


async def test_forged_harness_output_cannot_pass(executor):
    train, _ = problem_set()
    item = next(i for i in train if i["name"] == "sum_pairs")
    # Prints a results line claiming every test's output was "0": the comparison is outside.
    forged = (
        "import json, sys\n"
        "sys.stdout.write('\\n\\x00ATROPOS-RESULTS\\x00' + json.dumps("
        "[{'stdout': '0', 'returncode': 0}] * 6) + '\\n')\n"
    )
    report = await executor.run(forged, item)
    assert not report.all_passed


def test_code_extraction_takes_fenced_blocks():
    text = "Plan first.\n```python\nprint(1)\n```\nthen\n```\nprint(2)\n```\n"
    assert extract_python_code_blocks(text) == ["print(1)\n", "print(2)\n"]
    assert extract_python_code_blocks("no code here") == []


def test_output_and_value_comparison():
    assert outputs_match("1 2\n3\n", " 1  2 \n3")
    assert outputs_match("0.333333", "0.33333")
    assert not outputs_match("1\n2", "1")
    assert not outputs_match("abc", "abd")
    assert values_match([1, [2.0000001]], [1, [2.0]])
    assert not values_match(True, 1) and not values_match("1", 1)


async def test_the_environment_scores_a_group_in_the_sandbox(tiny_model_dir, tmp_path):
    from atroposlib.envs.cli import build_env, parse_cli
    from environments.code_execution_server import CodingEnv

    serve = {"model": str(tiny_model_dir), "base_url": "http://127.0.0.1:9/v1"}  # never called
    argv = process_argv(serve, tmp_path / "unused.jsonl", group_size=4)
    env = build_env(CodingEnv, parse_cli(CodingEnv, argv))
    await env.setup()
    item = next(i for i in env.train if i["problem_type"] == "stdin_stdout")
    answers = [
        f"Here it is:\n```python\n{item['solution']}```\n",
        "```python\nprint('wrong')\n```\n",
        "I will not write code.",
        f"```python\n{item['solution']}```",  # right, but cut at the token limit
    ]
    rollouts = [
        {
            "text": text,
            "messages": [{"role": "assistant", "content": text}],
            "finish_reason": "length" if i == 3 else "stop",
            "tokens": [1, 2, 3],
            "masks": [-100, 2, 3],
            "logprobs": [1.0, -0.5, -0.5],
        }
        for i, text in enumerate(answers)
    ]
    group = await env.score(rollouts, item)
    assert group["scores"] == [1.0, -1.0, -1.0, 1.0]
    assert [o["set_advantage_to_zero"] for o in group["overrides"]] == [False, False, False, True]
    assert env.end_reasons["ok"] == 3 and env.end_reasons["no_code"] == 0
