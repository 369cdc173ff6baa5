"""RewardFunction base, the registry and CombinedReward."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from atroposlib.envs.reward_fns import CombinedReward, RewardFunction, RewardRegistry, registry

BUILTINS = [
    "accuracy",
    "cascading_r1_math",
    "chandas_meter",
    "combined",
    "cosine_scaled",
    "crossword_format",
    "format",
    "r1",
    "reasoning_steps",
    "repetition_penalty",
]


def test_every_builtin_reward_is_registered():
    assert set(BUILTINS) <= set(registry.list())


def test_create_from_name_dict_and_inline_params():
    assert registry.create("format").weight == 1.0
    r = registry.create({"type": "repetition_penalty", "weight": 2.0, "params": {"ngram_size": 2}})
    assert (r.weight, r.ngram_size, r.name) == (2.0, 2, "repetition_penalty")
    assert registry.create({"type": "repetition_penalty", "ngram_size": 4}).ngram_size == 4


@pytest.mark.parametrize(
    "config, error, text",
    [
        ("nope", KeyError, "unknown reward function 'nope'"),
        ({"weight": 1.0}, ValueError, "no 'type'"),
        (3, ValueError, "name or a dict"),
    ],
)
def test_create_bad_config_raises_clearly(config, error, text):
    with pytest.raises(error, match=text):
        registry.create(config)


def test_register_decorator_forms_and_type_check():
    reg = RewardRegistry()

    @reg.register
    class LengthReward(RewardFunction):
        def compute(self, completions, **kwargs):
            return [float(len(self.get_content(c))) for c in completions]

    @reg.register(name="const")
    class Const(RewardFunction):
        def compute(self, completions, **kwargs):
            return [1.0] * len(completions)

    assert reg.list() == ["const", "length"]
    assert reg.create("length", weight=0.5)(["abcd"]) == [2.0]
    with pytest.raises(TypeError):
        reg.register(object)


class _Boom(RewardFunction):
    def compute(self, completions, **kwargs):
        raise RuntimeError("bad reward")


class _Short(RewardFunction):
    def compute(self, completions, **kwargs):
        return [1.0]


def test_failing_or_misshapen_reward_scores_zero_and_is_counted(caplog):
    boom = _Boom()
    assert boom(["a", "b"]) == [0.0, 0.0] and boom.error_count == 1
    short = _Short()
    assert short(["a", "b"]) == [0.0, 0.0] and short.error_count == 1
    assert "returned 1 scores for 2" in caplog.text


@pytest.mark.parametrize(
    "completion, text",
    [
        ("plain", "plain"),
        ({"role": "assistant", "content": "c"}, "c"),
        ({"message": {"content": "m"}}, "m"),
        ({"text": "t"}, "t"),
        ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "last"}], "last"),
        (
            {
                "content": [
                    {"type": "text", "text": "a"},
                    {"type": "image_url"},
                    {"type": "text", "text": "b"},
                ]
            },
            "ab",
        ),
        (SimpleNamespace(message=SimpleNamespace(content="choice")), "choice"),
        (SimpleNamespace(text="comp"), "comp"),
        (None, ""),
        ([], ""),
    ],
)
def test_get_content_accepts_common_completion_shapes(completion, text):
    assert RewardFunction.get_content(completion) == text


class _Fixed(RewardFunction):
    def __init__(self, values, **kw):
        super().__init__(**kw)
        self.values = values

    def compute(self, completions, **kwargs):
        return list(self.values)


def test_combined_reward_sums_weighted_scores_and_normalises():
    a, b = _Fixed([1.0, 0.0, 0.5], weight=2.0), _Fixed([0.0, 1.0, 0.5], weight=1.0)
    assert CombinedReward([a, b])(["x"] * 3) == [2.0, 1.0, 1.5]
    assert CombinedReward([a, b], normalization="sum")(["x"] * 3) == pytest.approx(
        [2 / 3, 1 / 3, 0.5]
    )
    assert CombinedReward([a, b], normalization="minmax")(["x"] * 3) == [1.0, 0.0, 0.5]
    assert CombinedReward([_Fixed([1.0, 1.0])], normalization="minmax")(["x", "y"]) == [0.0, 0.0]
    combined = registry.create(
        {"type": "combined", "rewards": ["format", {"type": "reasoning_steps"}]}
    )
    assert [r.name for r in combined.reward_functions] == ["format", "reasoning_steps"]
    with pytest.raises(ValueError, match="normalization"):
        CombinedReward([a], normalization="zscore")
    with pytest.raises(ValueError):
        CombinedReward([])
