"""``ReasoningGymEnv``'s pieces without a model: every task scores its gold answer as the
library does, scorer errors count as 0, items are the same across processes, answers
are extracted from ``<answer>`` or ``\\boxed{}``."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

reasoning_gym = pytest.importorskip("reasoning_gym")

from atroposlib.envs.adapters import _rg_worker  # noqa: E402
from atroposlib.envs.adapters.reasoning_gym import (  # noqa: E402
    GeneratorError,
    GeneratorPool,
    extract_answer,
    resolve_tasks,
    task_seed,
)

TASKS = _rg_worker.task_names()
# Generators that iterate over sets of strings, so their items follow PYTHONHASHSEED.
HASH_SENSITIVE = [
    "isomorphic_strings",
    "knight_swap",
    "polynomial_multiplication",
    "ransom_note",
    "word_ladder",
]
ROOT = Path(__file__).resolve().parents[2]


def test_every_installed_task_is_known():
    assert len(TASKS) >= 100
    assert set(HASH_SENSITIVE) <= set(TASKS)


@pytest.mark.parametrize("task", TASKS)
def test_task_scores_its_gold_answer_as_the_library_does(task):
    seed = task_seed(task, 0)
    for index in range(2):
        item = _rg_worker.generate_item(task, {}, seed, 10, index)
        gold = item["answer"]
        # The library's own dataset, made the library's way, scores the same entry.
        kwargs: Dict[str, Any] = {}
        if task == "composite":
            from reasoning_gym.composite import DatasetSpec

            kwargs["datasets"] = [DatasetSpec(**d) for d in _rg_worker.COMPOSITE_DEFAULT]
        library = reasoning_gym.create_dataset(task, seed=seed, size=10, **kwargs)
        entry = library[index]
        assert entry["question"] == item["question"] or task in HASH_SENSITIVE
        expected = library.score_answer(gold, item)
        reply = f"thinking...</think> <answer>{gold}</answer>"
        answer = extract_answer(reply, "answer_tag") if gold is not None else None
        [(score, error)] = _rg_worker.score_answers(task, {}, seed, 10, [answer], item)
        assert error is None
        assert score == expected
        # A reply with no answer scores what the library gives None (a few give 0.01).
        none_score = _rg_worker.score_answers(task, {}, seed, 10, [None], item)[0][0]
        assert none_score == library.score_answer(None, item) < 1.0


def test_a_scorer_that_raises_scores_zero_with_the_error():
    item = _rg_worker.generate_item("prime_factorization", {}, 1, 10, 0)
    results = _rg_worker.score_answers(
        "prime_factorization", {}, 1, 10, ["not a number", item["answer"]], item
    )
    assert results[0][0] == 0.0 and results[0][1] is not None
    assert results[1] == (1.0, None)


def test_extract_answer_reads_the_last_tag_or_balanced_box_after_think():
    assert extract_answer("<answer>1</answer> then <answer> 2 </answer>") == "2"
    assert extract_answer("<think><answer>9</answer></think>no answer") is None
    assert extract_answer("so \\boxed{\\frac{1}{2}} done", "boxed") == "\\frac{1}{2}"
    assert extract_answer("\\boxed{1} and \\boxed{x^{2}}", "boxed") == "x^{2}"
    assert extract_answer("\\boxed{unclosed", "boxed") is None
    with pytest.raises(ValueError, match="answer_format"):
        extract_answer("x", "json")


def test_resolve_tasks_accepts_all_lists_and_weights_and_names_bad_fields():
    assert resolve_tasks("all", TASKS) == {t: 1.0 for t in TASKS}
    assert resolve_tasks("chain_sum, gcd", TASKS) == {"chain_sum": 1.0, "gcd": 1.0}
    assert resolve_tasks({"gcd": 2, "lcm": 0}, TASKS) == {"gcd": 2.0}
    with pytest.raises(ValueError, match=r"env.tasks: unknown .*nope"):
        resolve_tasks(["gcd", "nope"], TASKS)
    with pytest.raises(ValueError, match="env.tasks: weights"):
        resolve_tasks({"gcd": -1}, TASKS)


def test_task_seeds_differ_per_task_and_are_stable():
    assert task_seed("gcd", 0) != task_seed("lcm", 0)
    assert task_seed("gcd", 0) != task_seed("gcd", 1)
    assert task_seed("gcd", 5) == task_seed("gcd", 5)


_ITEMS_SCRIPT = """
import asyncio, json, sys
from atroposlib.envs.adapters import _rg_worker
from atroposlib.envs.adapters.reasoning_gym import GeneratorPool, task_seed
tasks = json.loads(sys.argv[1])

async def main():
    pool = GeneratorPool(hash_seed=0)
    try:
        out = {}
        for t in tasks:
            out[t] = [await pool.call(_rg_worker.generate_item, t, {}, task_seed(t, 0), 10, i)
                      for i in range(1)]
            out[t + ":direct"] = [_rg_worker.generate_item(t, {}, task_seed(t, 0), 10, i)
                                  for i in range(1)]
        return out
    finally:
        await pool.close()

print(json.dumps(asyncio.run(main()), default=str, sort_keys=True))
"""


def _items_in_process(hash_seed: str) -> Dict[str, List[Any]]:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    out = subprocess.run(
        [sys.executable, "-c", _ITEMS_SCRIPT, json.dumps(HASH_SENSITIVE)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout)


def test_items_are_the_same_in_processes_with_different_hash_seeds():
    first, second = _items_in_process("1"), _items_in_process("2")
    for task in HASH_SENSITIVE:
        assert first[task] == second[task], task
    # Generated in the calling process instead, the items follow its hash seed: the
    # fixed-seed generator process is what makes the runs above agree.
    assert any(first[f"{t}:direct"] != second[f"{t}:direct"] for t in HASH_SENSITIVE)


def test_generator_pool_raises_on_a_failing_call_and_restarts_after_a_timeout():
    async def run() -> None:
        pool = GeneratorPool(timeout=120)
        try:
            with pytest.raises(GeneratorError, match="not registered"):
                await pool.call(_rg_worker.generate_item, "no_such_task", {}, 0, 1, 0)
            assert pool.restarts == 0
            # knight_swap takes a second or more per item, far past this limit: the child
            # is replaced.
            pool.timeout = 0.05
            with pytest.raises(GeneratorError, match="TimeoutError"):
                await pool.call(_rg_worker.generate_item, "knight_swap", {}, 0, 10, 0)
            assert pool.restarts == 1
            pool.timeout = 120
            assert not pool._children, "the timed-out child was killed"
            assert (await pool.call(_rg_worker.generate_item, "gcd", {}, 0, 10, 0))["question"]
            assert len(pool._children) == 1 and pool._children[0].proc.returncode is None
            # A child that died between calls is replaced on the next call.
            dead = pool._children[0].proc
            dead.kill()
            await dead.wait()
            assert (await pool.call(_rg_worker.generate_item, "gcd", {}, 0, 10, 1))["question"]
            assert len(pool._children) == 1 and pool._children[0].proc is not dead
        finally:
            await pool.close()

    asyncio.run(run())


def test_cli_takes_tasks_as_weights_and_generator_configs_as_json():
    from atroposlib.envs.adapters.reasoning_gym import ReasoningGymEnv
    from atroposlib.envs.cli import parse_cli

    cfg = parse_cli(
        ReasoningGymEnv,
        [
            "process",
            "--env.tasks",
            '{"chain_sum": 3, "gcd": 1}',
            "--env.task_configs",
            '{"chain_sum": {"min_terms": 2, "max_terms": 3}}',
            "--env.answer_format",
            "boxed",
        ],
    )
    env_cfg = cfg.env_config
    assert resolve_tasks(env_cfg.tasks, TASKS) == {"chain_sum": 3.0, "gcd": 1.0}
    assert env_cfg.task_configs == {"chain_sum": {"min_terms": 2, "max_terms": 3}}
    item = _rg_worker.generate_item("chain_sum", env_cfg.task_configs["chain_sum"], 0, 10, 0)
    assert 2 <= item["metadata"]["num_terms"] <= 3


def test_enum_fields_of_a_task_config_take_their_names():
    # aiw's task_types wants TaskType members; from --env.task_configs they come as names.
    cfg = {"task_types": ["siblings"], "task_type_weights": [1.0]}
    items = [_rg_worker.generate_item("aiw", cfg, 3, 100, i) for i in range(5)]
    assert {it["metadata"]["task_type"] for it in items} == {"siblings"}
    with pytest.raises(ValueError, match=r"aiw.task_types: 'sibs' is not one of siblings"):
        _rg_worker.make_dataset("aiw", {"task_types": ["sibs"], "task_type_weights": [1.0]}, 3, 10)
