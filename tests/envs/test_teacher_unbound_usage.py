"""TeacherDistillationEnv as test code built for the original uses it: instances made with
``object.__new__`` and only ``config``/``teacher_server``/``tokenizer`` set, methods called
unbound, and the module-level ``ServerManager``, ``resolve_openai_configs`` and
``transformers.AutoTokenizer.from_pretrained`` replaced and looked up at call time."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

import atroposlib.envs.teacher_distillation_env as tde
from atroposlib.envs.server_handling.server_baseline import APIServerConfig, ServerBaseline
from atroposlib.envs.teacher_distillation_env import TeacherDistillationEnv


class Teacher:
    """Answers ``get_logprobs`` with two ids per position; fails on call ``fail_on``."""

    def __init__(self, fail_on: int = 0):
        self.calls = 0
        self.fail_on = fail_on

    async def get_logprobs(self, **kwargs: Any) -> dict[str, Any]:
        self.calls += 1
        if self.calls == self.fail_on:
            raise RuntimeError("teacher down")
        ids = kwargs["input_ids"]
        return {
            "prompt_tokens": ids,
            "prompt_topk_token_ids": [[t, t + 1] for t in ids],
            "prompt_topk_logprobs": [[-0.1, -0.2] for _ in ids],
        }


class Env(TeacherDistillationEnv):
    async def get_next_item(self):
        return None

    async def evaluate(self, *args, **kwargs):
        return None


def bare(top_k: int = 2, teacher: Any = None, enabled: bool = True) -> Env:
    env = object.__new__(Env)
    env.config = SimpleNamespace(teacher_enabled=enabled, teacher_top_k=top_k)
    env.teacher_server = Teacher() if teacher is None else teacher
    return env


def group(overrides: Any = None) -> dict[str, Any]:
    return {
        "tokens": [[1, 2, 3], [4, 5]],
        "group_overrides": overrides,
        "masks": [[-100, 2, 3], [-100, 5]],
        "scores": [1.0, 0.0],
    }


async def test_attach_on_an_instance_without_init_state():
    env = bare()
    out = await TeacherDistillationEnv._attach_teacher_distillation(env, group())
    assert out["distill_token_ids"] == [[[1, 2], [2, 3], [3, 4]], [[4, 5], [5, 6]]]
    assert out["distill_logprobs"][1] == [[-0.1, -0.2], [-0.1, -0.2]]


@pytest.mark.parametrize(
    ("top_k", "overrides", "calls", "attached"),
    [
        (-1, None, 0, False),  # disabled by the config
        (0, None, 2, True),  # the sampled token only: still fetched
        (2, {"skip_teacher_top_k": True}, 0, False),
    ],
)
async def test_attach_top_k_rules_without_init_state(top_k, overrides, calls, attached):
    env = bare(top_k)
    out = await TeacherDistillationEnv._attach_teacher_distillation(env, group(overrides))
    assert env.teacher_server.calls == calls
    assert (out["distill_token_ids"] is not None) is attached
    assert (out["distill_logprobs"] is not None) is attached


async def test_attach_failure_drops_the_payload_without_init_state():
    env = bare(teacher=Teacher(fail_on=2))
    out = await TeacherDistillationEnv._attach_teacher_distillation(env, group())
    assert out["distill_token_ids"] is None and out["distill_logprobs"] is None


async def test_attach_uses_an_instance_fetch_and_the_group_top_k():
    env = bare(top_k=0, teacher=object())
    seen: list[int] = []

    async def fetch(seq, top_k):
        seen.append(top_k)
        return [[t] for t in seq], [[-0.1] for _ in seq]

    env._fetch_teacher_for_sequence = fetch
    out = await TeacherDistillationEnv._attach_teacher_distillation(
        env, group({"teacher_top_k": 7})
    )
    assert seen == [7, 7]
    assert out["distill_token_ids"] == [[[1], [2], [3]], [[4], [5]]]


async def test_attach_leaves_the_group_alone_when_the_config_disables_the_teacher():
    env = bare(enabled=False)
    out = await TeacherDistillationEnv._attach_teacher_distillation(env, group())
    assert "distill_token_ids" not in out and env.teacher_server.calls == 0


class Tok:
    def __init__(self, vocab: dict[str, int], name: str | None = None):
        self.vocab = vocab
        if name is not None:
            self.name_or_path = name

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def test_mismatched_vocabulary_through_patched_auto_tokenizer(monkeypatch):
    env = object.__new__(Env)
    env.tokenizer = Tok({"a": 1}, "student-model")
    loaded: list[tuple] = []
    monkeypatch.setattr(
        "transformers.AutoTokenizer.from_pretrained",
        lambda *args, **kwargs: loaded.append(args) or Tok({"b": 1}),
    )
    with pytest.raises(ValueError, match="^Cross-tokenizer distillation is not supported"):
        TeacherDistillationEnv._validate_teacher_tokenizer_compatibility(
            env, teacher_tokenizer_name="teacher-model"
        )
    assert loaded == [("teacher-model",)]
    # The student tokenizer's own name needs no load at all.
    TeacherDistillationEnv._validate_teacher_tokenizer_compatibility(
        env, teacher_tokenizer_name="student-model"
    )
    assert len(loaded) == 1
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: Tok({"a": 1}))
    TeacherDistillationEnv._validate_teacher_tokenizer_compatibility(env, "same-vocab")


def test_unloadable_teacher_tokenizer_is_the_same_error(monkeypatch):
    env = object.__new__(Env)
    env.tokenizer = Tok({"a": 1}, "student-model")

    def missing(*args, **kwargs):
        raise OSError("no such tokenizer")

    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", missing)
    with pytest.raises(ValueError, match="^Cross-tokenizer distillation is not supported"):
        TeacherDistillationEnv._validate_teacher_tokenizer_compatibility(env, "gone")


class CapturingManager:
    def __init__(self, configs, slurm=False, testing=False):
        self.configs = configs
        self.slurm = slurm
        self.testing = testing


@pytest.fixture
def base_init_only_config(monkeypatch):
    """BaseEnv.__init__ replaced by one that sets only ``config`` and ``tokenizer``."""

    def init(self, config, server_configs, slurm=False, testing=False):
        self.config = config
        self.tokenizer = Tok({"a": 1}, "student-model")

    monkeypatch.setattr(tde.BaseEnv, "__init__", init)


@pytest.fixture
def validated(monkeypatch) -> list[str]:
    names: list[str] = []

    def validate(self, teacher_tokenizer_name):
        names.append(teacher_tokenizer_name)

    monkeypatch.setattr(Env, "_validate_teacher_tokenizer_compatibility", validate)
    return names


def test_init_without_teacher_configs_is_an_error(base_init_only_config):
    config = SimpleNamespace(teacher_enabled=True, teacher_top_k=0)
    with pytest.raises(ValueError, match="no teacher server configuration was provided"):
        Env(config=config, server_configs=[])


@pytest.mark.parametrize("as_list", [True, False])
def test_init_builds_the_teacher_manager_through_the_module_name(
    base_init_only_config, validated, monkeypatch, as_list
):
    monkeypatch.setattr(tde, "ServerManager", CapturingManager)
    teacher = APIServerConfig(
        model_name="explicit-model",
        tokenizer_name="explicit-tokenizer",
        base_url="http://explicit/v1",
        api_key="x",
        server_type="vllm",
    )
    config = SimpleNamespace(teacher_enabled=True, teacher_top_k=0)
    env = Env(
        config=config,
        server_configs=[],
        teacher_server_configs=[teacher] if as_list else teacher,
    )
    assert isinstance(env.teacher_server, CapturingManager)
    assert env.teacher_server.configs == [teacher]
    assert (env.teacher_server.slurm, env.teacher_server.testing) == (False, False)
    assert validated == ["explicit-tokenizer"]


@pytest.mark.parametrize("tokenizer_name", ["", "none"])
def test_init_validates_the_model_name_when_no_tokenizer_is_named(
    base_init_only_config, validated, monkeypatch, tokenizer_name
):
    monkeypatch.setattr(tde, "ServerManager", CapturingManager)
    teacher = APIServerConfig(model_name="teacher-model", tokenizer_name=tokenizer_name)
    Env(SimpleNamespace(teacher_enabled=True, teacher_top_k=0), [], teacher)
    assert validated == ["teacher-model"]


def test_init_rejects_a_teacher_with_another_vocabulary(base_init_only_config, monkeypatch):
    monkeypatch.setattr(tde, "ServerManager", CapturingManager)
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: Tok({}))
    teacher = APIServerConfig(model_name="other-model")
    with pytest.raises(ValueError, match="^Cross-tokenizer distillation is not supported"):
        Env(SimpleNamespace(teacher_enabled=True, teacher_top_k=0), [], teacher)
    same = APIServerConfig(model_name="m", tokenizer_name="student-model")
    Env(SimpleNamespace(teacher_enabled=True, teacher_top_k=0), [], same)  # no load


def test_resolve_is_none_when_nothing_configures_a_teacher():
    assert (
        Env._resolve_teacher_server_configs(
            default_teacher_server_configs=None, yaml_config={}, cli_passed_flags={}
        )
        is None
    )


def test_resolve_hands_the_teacher_namespace_over_as_openai(monkeypatch):
    captured: dict[str, Any] = {}

    def resolve(**kwargs):
        captured.update(kwargs)
        return ["resolved"]

    monkeypatch.setattr(tde, "resolve_openai_configs", resolve)
    default = APIServerConfig(
        model_name="teacher-model", base_url="http://teacher/v1", api_key="x", server_type="vllm"
    )
    out = Env._resolve_teacher_server_configs(
        default_teacher_server_configs=default,
        yaml_config={"teacher": {"tokenizer_name": "teacher-tokenizer"}},
        cli_passed_flags={"teacher.base_url": "http://override/v1"},
    )
    assert out == ["resolved"]
    assert captured["openai_config_dict"]["base_url"] == "http://override/v1"
    assert captured["openai_config_dict"]["tokenizer_name"] == "teacher-tokenizer"
    assert captured["openai_config_dict"]["model_name"] == "teacher-model"
    assert captured["yaml_config"] == {"openai": {"tokenizer_name": "teacher-tokenizer"}}
    assert captured["cli_passed_flags"] == {"openai.base_url": "http://override/v1"}


def test_resolve_reports_list_errors_in_the_teacher_namespace():
    yaml = {"teacher": [{"base_url": "http://a/v1"}, {"base_url": "http://b/v1"}]}
    with pytest.raises(ValueError, match=r"--teacher\.\*"):
        Env._resolve_teacher_server_configs(None, yaml, {"teacher.model_name": "x"})


def test_resolve_turns_a_server_baseline_default_into_a_server_config():
    [one] = Env._resolve_teacher_server_configs(
        ServerBaseline(timeout=7), {}, {"teacher.base_url": "http://t/v1"}
    )
    assert isinstance(one, APIServerConfig)
    assert (one.base_url, one.timeout) == ("http://t/v1", 7)
