"""Drop-in behaviour of the environment runtime: config class, group validation, failures,
server probes, teacher extension points and messages that say what to do."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import textwrap
from typing import Optional

import httpx
import numpy as np
import openai
import pytest
import yaml

from atroposlib.envs import health
from atroposlib.envs.base import BaseEnv, BaseEnvConfig
from atroposlib.envs.cli import CliError, env_config_class, parse_cli
from atroposlib.envs.health import FailureTracker, ServerWatch, TooManyFailuresError, is_transient
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.validation import InvalidGroupError, normalize_group
from atroposlib.frontend.jsonl2html import create_html_for_group
from atroposlib.testing.ports import free_port

from .test_base_hooks import group, make_env

SERVER = APIServerConfig(base_url="http://127.0.0.1:9/v1", model_name="m", health_check=False)


class GameConfig(BaseEnvConfig):
    debug_mode: bool = False
    dictionary_path: Optional[str] = None  # noqa: UP045 - as in the original's env files
    starting_level: int = 1


class _Hooks:
    """The required hooks, doing nothing (these tests exercise the machinery)."""

    async def setup(self):
        pass

    async def get_next_item(self):
        return None

    async def evaluate(self, *args, **kwargs):
        pass


class _Env(_Hooks, BaseEnv):
    pass


class ImplicitConfigEnv(_Env):
    """Returns a config subclass from config_init() and never sets env_config_cls."""

    @classmethod
    def config_init(cls):
        return GameConfig(starting_level=4, use_wandb=False), SERVER


class ExplicitConfigEnv(_Env):
    """Sets env_config_cls and lets config_init() return a plain BaseEnvConfig."""

    env_config_cls = GameConfig

    @classmethod
    def config_init(cls):
        return BaseEnvConfig(group_size=3, use_wandb=False), SERVER


# ---------------------------------------------------------------- 1. config class


def test_config_class_comes_from_config_init_without_env_config_cls(tmp_path):
    assert env_config_class(ImplicitConfigEnv) is GameConfig
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"env": {"dictionary_path": "/words.txt"}}))
    parsed = parse_cli(
        ImplicitConfigEnv,
        ["serve", "--config", str(cfg), "--env.debug_mode", "true"],
        prog="x",
    )
    assert isinstance(parsed.env_config, GameConfig)
    assert parsed.env_config.debug_mode is True
    assert parsed.env_config.dictionary_path == "/words.txt"
    assert parsed.env_config.starting_level == 4  # the config_init() value
    with pytest.raises(CliError, match=r"--env\.starting_level"):
        parse_cli(ImplicitConfigEnv, ["serve", "--env.starting_level", "high"], prog="x")


def test_explicit_env_config_cls_still_wins_over_a_base_config_init():
    assert env_config_class(ExplicitConfigEnv) is GameConfig
    parsed = parse_cli(ExplicitConfigEnv, ["process", "--env.starting_level", "7"], prog="x")
    assert isinstance(parsed.env_config, GameConfig)
    assert (parsed.env_config.starting_level, parsed.env_config.group_size) == (7, 3)


def test_help_lists_the_config_init_class_fields(capsys):
    with pytest.raises(SystemExit):
        parse_cli(ImplicitConfigEnv, ["serve", "--help"], prog="x")
    out = capsys.readouterr().out
    assert "--env.dictionary_path" in out and "--env.starting_level" in out


# ------------------------------------------------------------ 2. group validation


def test_batch_encoding_numpy_and_torch_become_int_lists():
    torch = pytest.importorskip("torch")
    from transformers import BatchEncoding

    g = {
        "tokens": [
            BatchEncoding({"input_ids": [1, 2, 3], "attention_mask": [1, 1, 1]}),
            np.array([4, 5, 6], dtype=np.int64),
            torch.tensor([[7, 8, 9]]),  # a batch of one, as return_tensors="pt" gives
        ],
        "masks": [[-100, 2, 3], np.array([-100, 5, 6]), (-100, 8, 9)],
        "scores": np.array([0.5, 1.0, 0.0]),
        "inference_logprobs": [np.array([1.0, -0.5, -0.1], dtype=np.float32)] * 3,
    }
    out = normalize_group(g)
    assert out["tokens"] == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert all(type(v) is int for seq in out["tokens"] + out["masks"] for v in seq)
    assert out["scores"] == [0.5, 1.0, 0.0] and type(out["scores"][0]) is float
    assert json.loads(json.dumps(out))["masks"][2] == [-100, 8, 9]


@pytest.mark.parametrize(
    "change, field",
    [
        ({"tokens": ["{'input_ids': [1, 2]}", [1, 2]]}, "tokens[0]"),
        ({"tokens": [[1, 2.5], [1, 2]]}, "tokens[0][1]"),
        ({"masks": [[1, 2]]}, "masks"),
        ({"masks": [[1], [1, 2]]}, "masks[0]"),
        ({"scores": [1.0]}, "scores"),
        ({"scores": [1.0, float("nan")]}, "scores[1]"),
        ({"tokens": [np.array([1.0, 2.0]), [1, 2]]}, "tokens[0]"),
        ({"tokens": [{"ids": [1, 2]}, [1, 2]]}, "tokens[0]"),
        ({"messages": [[{"content": "no role"}], []]}, "messages[0][0]"),
        ({"overrides": [{"t": object()}, {}]}, "overrides"),
        ({"item_uuid": {1, 2}}, "item_uuid"),
    ],
)
def test_invalid_groups_are_refused_naming_the_field(change, field):
    g = {"tokens": [[1, 2], [1, 2]], "masks": [[-100, 2], [-100, 2]], "scores": [1.0, 0.0]}
    g.update(change)
    with pytest.raises(InvalidGroupError) as err:
        normalize_group(g)
    assert err.value.field == field


async def test_process_writer_never_writes_an_invalid_group(tmp_path, caplog):
    from transformers import BatchEncoding

    out = tmp_path / "g.jsonl"
    env = make_env(group_size=4, data_path_to_save_groups=str(out))
    env.process_mode = True
    encoded = group()
    encoded["tokens"] = [BatchEncoding({"input_ids": t}) for t in encoded["tokens"]]
    await env.handle_send_to_api(encoded, do_send_to_api=False)
    broken = group()
    broken["tokens"][1] = "not tokens"
    await env.handle_send_to_api(broken, do_send_to_api=False)
    env.jsonl_writer.close()
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 1 and lines[0]["tokens"] == group()["tokens"]
    assert env.items_rejected == {"invalid_tokens": 1}
    assert "tokens[1]" in caplog.text
    assert env.runner.failures.consecutive == 1


def test_group_writer_refuses_instead_of_stringifying(tmp_path):
    from atroposlib.envs.files import JsonlGroupWriter

    writer = JsonlGroupWriter(tmp_path / "g.jsonl")
    with pytest.raises(TypeError):
        writer.write({"tokens": [[1]], "extra": object()})
    writer.close()


# ------------------------------------------------------------ 3. failures stop


def _status_error(code: int) -> openai.APIStatusError:
    request = httpx.Request("POST", "http://x/v1/chat/completions")
    response = httpx.Response(code, request=request)
    return openai.APIStatusError("boom", response=response, body=None)


@pytest.mark.parametrize(
    "err, transient",
    [
        (httpx.ConnectError("refused"), True),
        (asyncio.TimeoutError(), True),
        (_status_error(500), True),
        (_status_error(503), True),
        (_status_error(429), True),
        (_status_error(400), False),
        (_status_error(404), False),
        (ValueError("bad parse"), False),
        (RuntimeError("wrapped"), False),
    ],
)
def test_transient_errors_are_told_apart(err, transient):
    assert is_transient(err) is transient


def test_a_transient_error_wrapped_in_another_is_transient():
    try:
        try:
            raise httpx.ReadTimeout("slow")
        except httpx.ReadTimeout as inner:
            raise RuntimeError("collect failed") from inner
    except RuntimeError as err:
        assert is_transient(err)


def test_backoff_grows_with_jitter_and_the_limit_stops():
    now = [0.0]
    tracker = FailureTracker(max_failures=5, clock=lambda: now[0])
    delays = [tracker.record_failure(httpx.ConnectError("x"), "collect") for _ in range(4)]
    assert all(0.5 * 0.5 * 2**i <= d <= 0.5 * 2**i for i, d in enumerate(delays))
    assert not tracker.ready()
    now[0] = tracker.resume_at
    assert tracker.ready()
    with pytest.raises(TooManyFailuresError) as err:
        tracker.record_failure(ValueError("parse"), "collect_trajectories")
    assert "5 consecutive failures" in str(err.value)
    assert "ValueError: parse" in str(err.value)
    assert "ValueError: parse" in err.value.last_traceback
    tracker.record_success()
    assert tracker.consecutive == 0 and tracker.ready()


def test_non_transient_failures_do_not_back_off():
    tracker = FailureTracker(max_failures=0)
    for _ in range(50):  # 0 = no limit
        assert tracker.record_failure(_status_error(400), "collect") == 0.0
    assert tracker.ready()


# ------------------------------------------------------- 9. inference server probes


async def test_probe_names_a_refused_connection():
    url = f"http://127.0.0.1:{free_port()}/v1"
    [result] = await health.probe_servers([url])
    assert not result.ok and result.reason == "connection refused"
    message = health.unreachable_message([result])
    assert message.startswith(f"no inference server reachable: {url} (connection refused)")
    assert "atropos-serve-model" in message


async def test_server_watch_reports_each_minute_and_gives_up(caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="atroposlib.envs.health")
    fatal = []
    watch = ServerWatch(
        [f"http://127.0.0.1:{free_port()}/v1"], 0.3, fatal.append, interval=0.1, status_every=60
    )
    await watch.check_once()
    assert watch.all_down and not fatal
    await watch.check_once()
    assert caplog.text.count("no inference server answering") == 1  # once a minute
    assert caplog.text.count("start one with `atropos-serve-model") == 1  # how, the first time
    await asyncio.sleep(0.35)
    await watch.check_once()
    assert len(fatal) == 1 and isinstance(fatal[0], health.ServersDownError)
    assert "max_server_downtime" in str(fatal[0])


async def test_failures_while_all_servers_are_down_are_not_counted():
    runner = make_env(group_size=2, max_consecutive_failures=2).runner
    runner.server_watch = ServerWatch(["http://127.0.0.1:9/v1"], 600, runner.stop_with_error)
    runner.server_watch.all_down = True
    for _ in range(5):
        runner.record_failure(httpx.ConnectError("refused"), "collect_trajectories")
    assert runner.fatal_error is None and not runner.can_start_work()
    runner.server_watch.all_down = False
    runner.record_failure(ValueError("x"), "collect_trajectories")
    runner.record_failure(ValueError("x"), "collect_trajectories")
    assert isinstance(runner.fatal_error, TooManyFailuresError)
    with pytest.raises(TooManyFailuresError):
        runner.raise_if_fatal()


# ----------------------------------------------------------------- 5. teacher env


def test_teacher_extension_points_and_patchable_module_names(monkeypatch):
    import atroposlib.envs.teacher_distillation_env as tde

    class Distill(_Hooks, tde.TeacherDistillationEnv):
        pass

    for name in (
        "_attach_teacher_distillation",
        "_validate_teacher_tokenizer_compatibility",
        "_resolve_teacher_server_configs",
    ):
        assert callable(getattr(Distill, name))
    built, resolved = [], []

    class FakeManager:
        def __init__(self, configs, **kwargs):
            built.append(configs)
            self.servers = []

    def fake_resolve(
        default_server_configs, openai_config_dict, yaml_config, cli_passed_flags, logger=None
    ):
        resolved.append(openai_config_dict)
        return [APIServerConfig(**openai_config_dict)]

    monkeypatch.setattr(tde, "ServerManager", FakeManager)
    monkeypatch.setattr(tde, "resolve_openai_configs", fake_resolve)
    config = tde.TeacherDistillationConfig(
        teacher_enabled=True, use_wandb=False, tokenizer_name="teacher"
    )
    env = Distill(config, [SERVER], teacher_server_configs={"model_name": "teacher"})
    assert resolved == [{"model_name": "teacher"}]
    assert built[0][0].model_name == "teacher"
    assert isinstance(env.teacher_server, FakeManager)
    with pytest.raises(ValueError, match="no teacher server configuration was provided"):
        Distill(config, [SERVER])


# --------------------------------------------------- 10, 11, 14: messages to the user


def test_unknown_flag_suggests_the_closest_field():
    with pytest.raises(CliError, match=r"did you mean --env\.group_size\?"):
        parse_cli(ImplicitConfigEnv, ["serve", "--env.groupsize", "8"], prog="x")
    with pytest.raises(CliError, match=r"--env\.starting_level"):
        parse_cli(ImplicitConfigEnv, ["serve", "--env.starting_levl=2"], prog="x")


async def test_rollout_api_not_reachable_names_the_url(caplog):
    caplog.set_level(logging.INFO, logger="atroposlib.envs.runner")
    from atroposlib.envs.api_client import RolloutAPIClient

    url = f"http://127.0.0.1:{free_port()}"
    env = make_env(group_size=2, rollout_server_url=url)
    env.runner.api = RolloutAPIClient(url)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(env.register_env(), 1.0)
    await env.runner.api.aclose()
    assert f"rollout API at {url} not reachable yet" in caplog.text


# ------------------------------------------------------------ 12. jsonl2html


def test_group_without_messages_renders_nothing():
    assert create_html_for_group({"messages": [], "scores": [1.0]}, 0) == ""
    assert create_html_for_group({"scores": [1.0]}, 0) == ""
    assert "<details>" in create_html_for_group({"messages": ["hi"], "scores": [1.0]}, 0)


# ------------------------------------------------------------ 13. packaging


def test_installed_atroposlib_does_not_shadow_a_users_environments_package(tmp_path):
    user_pkg = tmp_path / "environments"
    user_pkg.mkdir()  # a namespace package: no __init__.py, as many checkouts have
    (user_pkg / "my_env.py").write_text(
        textwrap.dedent(
            """
            import atroposlib
            print("USER ENV", __file__)
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    ran = subprocess.run(
        [sys.executable, "-m", "environments.my_env"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert f"USER ENV {user_pkg / 'my_env.py'}" in ran.stdout
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = subprocess.run(
        [sys.executable, "-c", "import importlib.util as u; print(u.find_spec('environments'))"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.stdout.strip() == "None", probe.stdout + probe.stderr
