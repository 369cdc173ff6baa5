"""The pieces of ``example_trainer/configs/reasoning_gym_cpu.yaml``: its env flags parse,
its warm-up examples are the task's gold answers, its eval runs against a real server and
uses items of a seed the training never draws from."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml

pytest.importorskip("reasoning_gym")

from atroposlib.envs.adapters import _rg_worker  # noqa: E402
from atroposlib.envs.adapters.reasoning_gym import ReasoningGymEnv, extract_answer  # noqa: E402
from atroposlib.envs.cli import build_env, parse_cli  # noqa: E402
from environments import reasoning_gym_server as demo  # noqa: E402

CONFIG = Path(__file__).resolve().parents[2] / "example_trainer/configs/reasoning_gym_cpu.yaml"


def test_demo_env_args_select_the_demo_task_without_system_prompt():
    env_args = yaml.safe_load(CONFIG.read_text())["env_args"]
    cfg = parse_cli(ReasoningGymEnv, ["process", *env_args]).env_config
    assert cfg.tasks in (demo.DEMO_TASK, [demo.DEMO_TASK])
    assert cfg.task_configs == {demo.DEMO_TASK: demo.DEMO_CONFIG}
    assert cfg.system_prompt == "" and cfg.partial_credit is False
    assert cfg.seed == demo.DEMO_TRAIN_SEED and demo.DEMO_EVAL_SEED in cfg.eval_seeds


def test_warmup_examples_are_gold_answers_the_scorer_accepts():
    for messages, answer in demo.sft_examples(20, seed=0):
        item = next(
            it
            for i in range(200)
            if (it := demo._demo_item(demo.DEMO_TRAIN_SEED, i))["question"]
            == messages[-1]["content"]
        )
        [(score, error)] = _rg_worker.score_answers(
            demo.DEMO_TASK,
            demo.DEMO_CONFIG,
            demo.task_seed(demo.DEMO_TASK, demo.DEMO_TRAIN_SEED),
            demo.DEMO_SIZE,
            [extract_answer(answer)],
            item,
        )
        assert (score, error) == (1.0, None)


def test_warmup_never_shows_an_eval_question():
    held_out = {demo._demo_item(demo.DEMO_EVAL_SEED, i)["question"] for i in range(200)}
    train = [m[-1]["content"] for m, _ in demo.sft_examples(2000, seed=0)]
    assert len(train) == 2000 and not held_out & set(train)
    # Without the filter, sibling questions do repeat across seeds: the filter is needed.
    raw = {demo._demo_item(demo.DEMO_TRAIN_SEED, i)["question"] for i in range(2000)}
    assert held_out & raw


def test_env_skips_training_items_that_are_eval_questions(tmp_path):
    env_args = yaml.safe_load(CONFIG.read_text())["env_args"]
    argv = ["process", *env_args, "--openai.base_url", "http://127.0.0.1:9/v1"]
    env = build_env(ReasoningGymEnv, parse_cli(ReasoningGymEnv, argv))

    async def draw():
        await env.setup()
        try:
            items = [await env.get_next_item() for _ in range(300)]
            return items, await env.eval_questions(demo.DEMO_TASK)
        finally:
            await env.generator.close()

    items, held_out = asyncio.run(draw())
    assert len(held_out) > 150
    assert not {it["entry"]["question"] for it in items} & held_out
    assert env.eval_overlap_skipped > 0


def test_greedy_eval_scores_against_a_real_server(serve_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(serve_model["model"])
    score = demo.greedy_eval(serve_model["base_url"], tok, limit=8)
    assert 0.0 <= score <= 1.0
