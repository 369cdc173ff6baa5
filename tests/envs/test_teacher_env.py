"""TeacherDistillationEnv: teacher top-k logprobs attached before sending, against a real fake server."""

from __future__ import annotations

import pytest

from atroposlib.envs.base import ScoredDataGroup
from atroposlib.envs.cli import CliError, parse_cli
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.teacher_distillation_env import (
    TeacherDistillationConfig,
    TeacherDistillationEnv,
)
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import running_process

from .serve_helpers import fake_server_cmd


class DistillEnv(TeacherDistillationEnv):
    name = "distill"

    @classmethod
    def config_init(cls):
        return TeacherDistillationConfig(
            wandb_name="distill", use_wandb=False, group_size=2
        ), APIServerConfig(
            base_url="http://127.0.0.1:9/v1", model_name="student", health_check=False
        )

    async def setup(self):
        pass

    async def get_next_item(self):
        return None

    async def evaluate(self, *args, **kwargs):
        pass


@pytest.fixture(scope="module")
def teacher_port(tmp_path_factory):
    port = free_port()
    with running_process(
        fake_server_cmd(port, latency_ms=0),
        health_url=f"http://127.0.0.1:{port}/health",
        log_path=tmp_path_factory.mktemp("teacher") / "fake.log",
    ):
        yield port


def teacher(port: int, **kw) -> APIServerConfig:
    return APIServerConfig(
        base_url=f"http://127.0.0.1:{port}/v1",
        model_name="fake",
        server_type="vllm",
        tokenizer_name="student-tok",
        **kw,
    )


def make_env(port: int, top_k: int = 3, **kw) -> DistillEnv:
    config = TeacherDistillationConfig(
        wandb_name="distill",
        use_wandb=False,
        group_size=2,
        teacher_enabled=True,
        teacher_top_k=top_k,
        tokenizer_name="student-tok",
    )
    return DistillEnv(
        config,
        [APIServerConfig(base_url="http://127.0.0.1:9/v1", model_name="s")],
        teacher_server_configs=[teacher(port, **kw)],
    )


def group(**extra) -> ScoredDataGroup:
    g = ScoredDataGroup(
        tokens=[[104, 105, 33], [111, 107]], masks=[[-100, 105, 33], [-100, 107]], scores=[1.0, 0.0]
    )
    g.update(extra)
    return g


async def test_teacher_topk_is_attached_per_sequence_and_position(teacher_port):
    env = make_env(teacher_port, top_k=3)
    g = group()
    await env.handle_send_to_api(g, do_send_to_api=False)
    await env.close_servers()
    assert [len(x) for x in g["distill_token_ids"]] == [3, 2]
    assert all(len(pos) == 3 for seq in g["distill_token_ids"] for pos in seq)
    assert all(lp <= 0 for seq in g["distill_logprobs"] for pos in seq for lp in pos)


async def test_group_overrides_skip_or_change_top_k(teacher_port):
    env = make_env(teacher_port, top_k=3)
    skipped = group(group_overrides={"skip_teacher_top_k": True})
    one = group(group_overrides={"teacher_top_k": 1})
    await env.handle_send_to_api([skipped, one], do_send_to_api=False)
    await env.close_servers()
    assert skipped["distill_token_ids"] is None and skipped["distill_logprobs"] is None
    assert all(len(pos) == 1 for seq in one["distill_token_ids"] for pos in seq)


async def test_teacher_failure_drops_only_the_distill_payload(tmp_path):
    dead = free_port()
    env = make_env(dead, top_k=2, timeout=1, health_check=False)
    env.config.data_path_to_save_groups = str(tmp_path / "g.jsonl")
    g = group()
    await env.handle_send_to_api(g, do_send_to_api=False)
    await env.close_servers()
    assert g["distill_token_ids"] is None and g["distill_logprobs"] is None
    assert (tmp_path / "g.jsonl").read_text().count("\n") == 1  # the group itself is kept


class Vocab:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return self.vocab


def test_mismatched_teacher_tokenizer_is_an_error(teacher_port, monkeypatch):
    import atroposlib.envs.teacher_distillation_env as tde

    loaded = []
    monkeypatch.setattr(
        tde, "load_tokenizer", lambda name: loaded.append(name) or Vocab({"a": 0, "b": 1})
    )
    env = make_env(teacher_port)
    env.tokenizer = Vocab({"a": 0, "b": 1})
    env.teacher_server.servers[0].config.tokenizer_name = "same-vocab-other-name"
    env.check_teacher_tokenizer()  # same vocabulary under another name is fine
    assert loaded == ["same-vocab-other-name"]
    other = make_env(teacher_port)
    other.tokenizer = Vocab({"x": 0})
    other.teacher_server.servers[0].config.tokenizer_name = "different"
    with pytest.raises(ValueError, match="does not match"):
        other.check_teacher_tokenizer()


def test_teacher_enabled_without_servers_is_an_error():
    config = TeacherDistillationConfig(teacher_enabled=True, use_wandb=False)
    with pytest.raises(ValueError, match="teacher server"):
        DistillEnv(config, [APIServerConfig(base_url="http://127.0.0.1:9/v1")])


def test_teacher_cli_namespace_and_yaml(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("teacher:\n  model_name: t-yaml\n  base_url: http://127.0.0.1:1/v1\n")
    parsed = parse_cli(
        DistillEnv,
        [
            "serve",
            "--config",
            str(cfg),
            "--teacher.model_name",
            "t-cli",
            "--env.teacher_top_k",
            "4",
        ],
        prog="x",
    )
    assert parsed.env_config.teacher_top_k == 4
    assert parsed.extra_servers["teacher"][0].model_name == "t-cli"
    assert parsed.extra_servers["teacher"][0].base_url == "http://127.0.0.1:1/v1"
    with pytest.raises(CliError, match=r"--env\.teacher_top_k"):
        parse_cli(DistillEnv, ["serve", "--env.teacher_top_k", "-5"], prog="x")
