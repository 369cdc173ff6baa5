"""TeacherDistillationEnv's original interface: config resolution, constructor, tokenizer
check, per-sequence fetch and the group rules, with an in-process teacher."""

from __future__ import annotations

import logging
from typing import Any

import pytest

import atroposlib.envs.teacher_distillation_env as tde
from atroposlib.envs.cli import parse_cli
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.teacher_distillation_env import (
    TeacherDistillationConfig,
    TeacherDistillationEnv,
)

STUDENT = APIServerConfig(base_url="http://127.0.0.1:9/v1", model_name="s", health_check=False)


class Env(TeacherDistillationEnv):
    name = "teach"

    @classmethod
    def config_init(cls):
        return TeacherDistillationConfig(use_wandb=False, wandb_name="teach"), STUDENT

    async def setup(self):
        pass

    async def get_next_item(self):
        return None

    async def evaluate(self, *args, **kwargs):
        pass


class WithDefaultTeacher(Env):
    @classmethod
    def teacher_config_init(cls):
        return APIServerConfig(base_url="http://t:1/v1", model_name="teacher-default")


class FakeTeacher:
    """Answers get_logprobs with ``top_k`` ids per position (or a wrong length)."""

    def __init__(self, configs: Any, short: bool = False, fail: bool = False):
        self.configs = configs
        self.short = short
        self.fail = fail
        self.calls: list[dict[str, Any]] = []
        self.servers = []

    async def get_logprobs(self, **kwargs: Any) -> dict[str, Any]:
        self.calls.append(kwargs)
        if self.fail:
            raise RuntimeError("teacher down")
        n = len(kwargs["input_ids"]) - (1 if self.short else 0)
        k = kwargs["top_k"]
        return {
            "prompt_topk_token_ids": [[7] * k for _ in range(n)],
            "prompt_topk_logprobs": [[-0.5] * k for _ in range(n)],
        }


def make(monkeypatch, top_k: int = 2, enabled: bool = True, teacher=None, **fake_kw) -> Env:
    """An Env whose teacher manager is a FakeTeacher; the tokenizer names the constructor
    validates are recorded in ``env.checked`` (nothing is loaded)."""
    monkeypatch.setattr(tde, "ServerManager", lambda configs, **_: FakeTeacher(configs, **fake_kw))
    checked: list[str] = []
    monkeypatch.setattr(
        Env, "_validate_teacher_tokenizer_compatibility", lambda self, name: checked.append(name)
    )
    config = TeacherDistillationConfig(
        use_wandb=False, teacher_enabled=enabled, teacher_top_k=top_k, tokenizer_name="tok"
    )
    if teacher is None and enabled:
        teacher = APIServerConfig(base_url="http://t/v1", model_name="t", tokenizer_name="tok")
    env = Env(config, [STUDENT], teacher)
    env.checked = checked
    return env


def group(**extra: Any) -> dict[str, Any]:
    return {"tokens": [[1, 2, 3], [4, 5]], "masks": [[-100, 2, 3], [-100, 5]], "scores": [1, 0]} | (
        extra
    )


def test_namespace_and_default_teacher():
    assert Env.teacher_namespace == "teacher"
    assert Env.teacher_config_init() is None


def test_resolve_is_none_without_any_teacher_configuration():
    assert Env._resolve_teacher_server_configs(None, {}, {}) is None
    assert Env._resolve_teacher_server_configs(None, {"openai": {"model_name": "x"}}, {}) is None


def test_resolve_from_flags_yaml_and_defaults():
    [one] = Env._resolve_teacher_server_configs(
        None, {}, {"teacher.base_url": "http://a/v1", "teacher.model_name": "A"}
    )
    assert (one.base_url, one.model_name) == ("http://a/v1", "A")
    yaml = {"teacher": [{"base_url": "http://b/v1"}, {"base_url": "http://c/v1"}]}
    two = Env._resolve_teacher_server_configs(None, yaml, {})
    assert [c.base_url for c in two] == ["http://b/v1", "http://c/v1"]
    default = WithDefaultTeacher.teacher_config_init()
    [merged] = Env._resolve_teacher_server_configs(
        default, {"teacher": {"timeout": 5}}, {"teacher.model_name": "flag"}
    )
    assert (merged.base_url, merged.timeout, merged.model_name) == ("http://t:1/v1", 5, "flag")


def test_serve_command_line_wires_teacher_flags():
    parsed = parse_cli(
        Env,
        ["serve", "--teacher.base_url", "http://x/v1", "--teacher.model_name", "T"],
        "env.py",
    )
    [teacher] = parsed.extra_servers["teacher"]
    assert (teacher.base_url, teacher.model_name) == ("http://x/v1", "T")
    assert parse_cli(Env, ["serve"], "env.py").extra_servers["teacher"] is None
    fields = WithDefaultTeacher.get_cli_serve_config_cls()().teacher
    assert fields.model_name == "teacher-default"
    [from_default] = parse_cli(WithDefaultTeacher, ["serve"], "env.py").extra_servers["teacher"]
    assert from_default.model_name == "teacher-default"


def test_constructor_rules(monkeypatch):
    with pytest.raises(ValueError, match="no teacher server configuration"):
        make(monkeypatch, teacher=[])
    env = make(monkeypatch, teacher=APIServerConfig(model_name="bare", base_url="http://b/v1"))
    assert isinstance(env.teacher_server.configs, list) and len(env.teacher_server.configs) == 1
    assert env.teacher_tokenizer_name == "bare"  # tokenizer_name "none" falls back
    assert env.checked == ["bare"]
    named = make(monkeypatch, teacher=[APIServerConfig(model_name="m", tokenizer_name="tk")])
    assert named.teacher_tokenizer_name == "tk" and named.checked == ["tk"]
    empty_name = make(monkeypatch, teacher=[APIServerConfig(model_name="m2", tokenizer_name="")])
    assert empty_name.teacher_tokenizer_name == "m2"
    several = make(
        monkeypatch,
        teacher=[
            APIServerConfig(model_name=n, tokenizer_name=t)
            for n, t in zip("abc", "xyx", strict=True)
        ],
    )
    assert several.checked == ["x", "y"]  # every distinct teacher tokenizer, once
    assert make(monkeypatch, enabled=False).teacher_server is None


def test_constructor_takes_teacher_config_init(monkeypatch):
    monkeypatch.setattr(tde, "ServerManager", lambda configs, **_: FakeTeacher(configs))
    monkeypatch.setattr(tde, "load_tokenizer", lambda name: pytest.fail(f"loaded {name}"))
    config = TeacherDistillationConfig(
        use_wandb=False, teacher_enabled=True, tokenizer_name="teacher-default"
    )
    env = WithDefaultTeacher(config, [STUDENT])
    assert env.teacher_server.configs[0].model_name == "teacher-default"


class Vocab:
    def __init__(self, vocab: dict[str, int], name: str = ""):
        self.vocab = vocab
        self.name_or_path = name

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def test_tokenizer_compatibility(monkeypatch):
    env = make(monkeypatch)
    env.tokenizer = Vocab({"a": 0}, "tok")
    validate = TeacherDistillationEnv._validate_teacher_tokenizer_compatibility.__get__(env)
    loads: list[str] = []

    def load(name: str) -> Vocab:
        loads.append(name)
        if name == "missing":
            raise OSError("no such tokenizer")
        return Vocab({"a": 0} if name == "same" else {"b": 0})

    monkeypatch.setattr(tde, "load_tokenizer", load)
    validate("tok")  # the student tokenizer's own name
    assert loads == []
    validate("same")
    with pytest.raises(ValueError, match="does not match"):
        validate("other")
    with pytest.raises(ValueError, match="cannot be loaded"):
        validate("missing")


async def test_fetch_for_sequence_asks_for_prompt_logprobs(monkeypatch):
    env = make(monkeypatch)
    ids, lps = await env._fetch_teacher_for_sequence([1, 2, 3], 4)
    assert ids == [[7] * 4] * 3 and lps == [[-0.5] * 4] * 3
    assert env.teacher_server.calls == [
        {"input_ids": [1, 2, 3], "top_k": 4, "max_tokens": 1, "split": "train"}
    ]


async def test_attach_rules(monkeypatch, caplog):
    disabled = make(monkeypatch, enabled=False)
    g = group()
    assert await disabled._attach_teacher_distillation(g) == group()
    env = make(monkeypatch, top_k=2)
    full = await env._attach_teacher_distillation(group())
    assert [len(s) for s in full["distill_token_ids"]] == [3, 2]
    one = await env._attach_teacher_distillation(group(group_overrides={"teacher_top_k": 1}))
    assert one["distill_logprobs"][0] == [[-0.5]] * 3
    for g in (
        group(group_overrides={"skip_teacher_top_k": True}),
        group(group_overrides={"teacher_top_k": -1}),
        {"tokens": [], "masks": [], "scores": []},
    ):
        out = await env._attach_teacher_distillation(g)
        assert out["distill_token_ids"] is None and out["distill_logprobs"] is None
    with caplog.at_level(logging.WARNING):
        short = make(monkeypatch, short=True)
        out = await short._attach_teacher_distillation(group())
        assert out["distill_token_ids"] is None and "positions" in caplog.text
        failing = make(monkeypatch, fail=True)
        out = await failing._attach_teacher_distillation(group())
        assert out["distill_logprobs"] is None and "teacher down" in caplog.text
