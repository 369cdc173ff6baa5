"""Reward functions as the original's callers use them: defaults, function forms, names,
logging hooks, the registry's function entries and the similarity mode of cosine_scaled."""

from __future__ import annotations

from typing import Any

import pytest

from atroposlib.envs.reward_fns import registry
from atroposlib.envs.reward_fns.accuracy_reward import accuracy_reward
from atroposlib.envs.reward_fns.cascading_r1_math_reward import (
    cascading_r1_math_reward,
    get_completion_content,
)
from atroposlib.envs.reward_fns.cascading_r1_math_reward import (
    format_reward as think_format_reward,
)
from atroposlib.envs.reward_fns.chandas_meter_reward import ChandasMeterReward, iast_to_slp1
from atroposlib.envs.reward_fns.combined_reward import CombinedReward
from atroposlib.envs.reward_fns.cosine_scaled_reward import (
    CosineScaledReward,
    cosine_scaled_reward,
)
from atroposlib.envs.reward_fns.crossword_format_reward import crossword_format_reward
from atroposlib.envs.reward_fns.format_reward import FormatReward, format_reward
from atroposlib.envs.reward_fns.r1_reward import (
    AccuracyXReward,
    FormatReasoningReward,
    R1Reward,
    format_reasoning_reward,
    parse_reasoning_response,
    r1_reward,
)
from atroposlib.envs.reward_fns.r1_reward import accuracy_reward as r1_accuracy_reward
from atroposlib.envs.reward_fns.reasoning_steps_reward import reasoning_steps_reward
from atroposlib.envs.reward_fns.registry import LegacyFunctionWrapper, RewardRegistry
from atroposlib.envs.reward_fns.repetition_penalty_reward import repetition_penalty_reward
from atroposlib.envs.reward_fns.reward_function import RewardFunction

RIGHT = "<think>6*12</think><answer>\\boxed{72}</answer>"
WRONG = "<think>6*12</think><answer>\\boxed{70}</answer>"


class Recorder:
    def __init__(self) -> None:
        self.logged: list[dict[str, Any]] = []

    def log(self, metrics: dict[str, Any]) -> None:
        self.logged.append(metrics)


def test_original_defaults():
    assert FormatReward().require_all_tags is False
    assert R1Reward().format_weight == 0.5
    assert ChandasMeterReward().meter == "tristubh"
    # one of the tags is enough by default
    assert FormatReward()(["<think>only thinking</think>"]) == [1.0]
    assert R1Reward()([RIGHT], solution="72") == [1.5]


def test_function_forms():
    assert accuracy_reward([RIGHT, WRONG], solution="72") == [1.0, 0.0]
    assert accuracy_reward([RIGHT], ground_truth="72") == [1.0]
    assert format_reward(["<answer>x</answer>", "none"], preferred_tags=["answer"]) == [1.0, 0.0]
    assert r1_reward([RIGHT, WRONG], solution="72") == [1.5, 0.5]
    assert r1_accuracy_reward([RIGHT, WRONG], solution="72") == [1.0, 0.0]
    assert format_reasoning_reward([RIGHT, "no tags"]) == [0.5, 0.0]
    assert cascading_r1_math_reward([RIGHT, WRONG], solution="72") == [1.0, 0.2]
    assert think_format_reward([RIGHT, "<think>open"], reward_value=0.5) == [0.5, 0.0]
    assert get_completion_content({"message": {"content": "hi"}}) == "hi"
    assert reasoning_steps_reward(["Step 1: a\nStep 2: b\nStep 3: c", "none"]) == [1.0, 0.0]
    assert crossword_format_reward(["1 Across: CAT\n2 Down: DOG"]) == [1.0]
    repeated = " ".join(["the same words again"] * 20)
    assert repetition_penalty_reward(["all different words here now please"]) == [0.0]
    assert repetition_penalty_reward([repeated])[0] < -0.5


def test_reasoning_parts_and_rewards():
    parts = parse_reasoning_response("<think>hmm</think> <answer>4</answer>")
    assert parts["thinking"] == "hmm" and parts["answer"] == "4"
    assert parts["thinking_blocks"] == 1 and parts["unclosed_thinking"] is False
    assert parse_reasoning_response("<think>open")["unclosed_thinking"] is True
    fmt = FormatReasoningReward(allow_multiple_thinking=True)
    assert fmt(["<think>a</think><think>b</think> done"]) == [0.5]
    assert FormatReasoningReward()(["<think>a</think><think>b</think> done"]) == [0.0]
    exact = AccuracyXReward(exact_match=True)
    assert exact(["<think>x</think>Paris", "<think>x</think>paris!"], solution="paris") == [
        1.0,
        0.0,
    ]
    assert AccuracyXReward()(["<think>x</think>It is Paris."], solution="paris") == [1.0]
    assert AccuracyXReward(case_sensitive=True)(["<think>x</think>Paris"], solution="paris") == [
        0.0
    ]


def test_name_property_and_logging_hooks():
    reward = FormatReward()
    assert isinstance(RewardFunction.__dict__["name"], property)
    assert reward.name == "format" and FormatReward(name="mine").name == "mine"
    combined = CombinedReward(rewards=["format", {"type": "r1"}])
    assert combined.name == "combined(format,r1)"
    recorder = Recorder()
    combined.set_wandb_logger(logger=recorder)
    combined([RIGHT], solution="72")
    logged = {k for entry in recorder.logged for k in entry}
    assert "reward/format/mean_raw" in logged and "reward/r1/mean_weighted" in logged
    direct = Recorder()
    reward.set_wandb_logger(direct)
    reward.log_metrics(raw_rewards=[1.0, 0.0], weighted_rewards=[2.0, 0.0])
    assert direct.logged == [{"reward/format/mean_raw": 0.5, "reward/format/mean_weighted": 1.0}]


def test_registry_functions_and_required_names():
    local = RewardRegistry()

    def shout(completions, bonus=0.0, **kwargs):
        return [float(c.isupper()) + bonus for c in completions]

    local.register_function("shout", shout)
    assert local.get("shout") is shout and "shout" in local.list_registered()
    wrapped = local.create({"type": "shout", "weight": 2.0, "bonus": 0.5})
    assert isinstance(wrapped, LegacyFunctionWrapper) and wrapped.name == "shout"
    assert wrapped(["HI", "hi"]) == [3.0, 1.0]
    direct = LegacyFunctionWrapper(shout, weight=1.0)
    assert direct(["HI"], bonus=1.0) == [2.0]
    names = registry.load_required_functions(
        [
            "accuracy",
            {"type": "combined", "params": {"rewards": ["format", {"type": "r1"}]}},
            {"reward_functions": ["reasoning_steps"]},
        ]
    )
    assert names == {"accuracy", "combined", "format", "r1", "reasoning_steps"}
    with pytest.raises(KeyError, match="unknown reward"):
        registry.load_required_functions(["no_such_reward"])
    registry._load_reward_function("repetition_penalty")
    assert "repetition_penalty" in registry.list_registered()


def test_chandas_helpers():
    assert iast_to_slp1("bhārata kṛṣṇa śaiva") == "BArata kfzRa SEva"
    reward = ChandasMeterReward()
    assert reward._score_text("prose, not verse") < 0.5


def test_cosine_scaled_similarity_mode_with_a_local_encoder():
    from atroposlib.tiny_model import ensure_tiny_model

    model_dir = str(ensure_tiny_model())
    reward = CosineScaledReward(model_name=model_dir, min_reward=-1.0, max_reward=1.0)
    assert reward.similarity_mode
    same = reward(["the answer is 72"], solution="the answer is 72")
    assert same[0] == pytest.approx(1.0, abs=1e-4)
    other = reward(["banana banana"], solution="the answer is 72")[0]
    assert -1.0 <= other < 1.0
    assert reward([""], solution="x") == [0.0]  # default_reward
    emb = reward._get_embeddings(["a", "b c"])
    assert tuple(emb.shape)[0] == 2
    assert cosine_scaled_reward(["x"], solution="x", model_name=model_dir)[0] == pytest.approx(
        1.0, abs=1e-4
    )
    # without the original's arguments it stays the length-cosine reward
    length_mode = CosineScaledReward()
    assert not length_mode.similarity_mode
    assert length_mode(["\\boxed{72}"], solution="72")[0] > 0.5
