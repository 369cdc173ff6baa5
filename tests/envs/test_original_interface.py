"""BaseEnv as the original's subclasses and tools use it: the CLI config classes, the batch
share property, perf stats, registration and posting helpers."""

from __future__ import annotations

import gzip
import inspect
import json
from typing import Any

import httpx
import pytest
from pydantic import Field

from atroposlib.envs.base import BaseEnv, BaseEnvConfig
from atroposlib.envs.cli import CliError, parse_cli
from atroposlib.envs.server_handling.server_baseline import APIServerConfig


class Env(BaseEnv):
    name = "iface"

    @classmethod
    def config_init(cls):
        return BaseEnvConfig(use_wandb=False, wandb_name="iface", group_size=2), APIServerConfig(
            base_url="http://127.0.0.1:9/v1", model_name="m", health_check=False
        )

    async def setup(self):
        pass

    async def get_next_item(self):
        return None

    async def evaluate(self, *args, **kwargs):
        self.evaluated = True


def _env() -> Env:
    config, server = Env.config_init()
    return Env(config, [server], testing=True)


def test_mode_config_classes_carry_the_namespaces_and_config_init_defaults():
    serve_cls = Env.get_cli_serve_config_cls()
    fields = serve_cls.model_fields
    assert {"env", "openai", "slurm", "testing", "config"} <= set(fields)
    instance = serve_cls()
    assert instance.env.group_size == 2 and instance.openai.model_name == "m"
    process = Env.get_cli_process_config_cls()()
    assert process.env.include_messages is True  # process mode's forced value
    assert Env.get_cli_evaluate_config_cls()().env.use_wandb is True


def test_evaluate_config_instance_runs_evaluate_mode(monkeypatch, tmp_path):
    ran: list[Any] = []

    async def fake_run_evaluate(self):
        ran.append(self.config.group_size)

    monkeypatch.setattr(Env, "run_evaluate", fake_run_evaluate)
    cfg = Env.get_cli_evaluate_config_cls()(env={"group_size": 5}, testing=True)
    cfg.cli_cmd()
    assert ran == [5]


def test_an_overridden_mode_config_class_is_what_the_command_line_parses():
    class Extra(Env):
        @classmethod
        def get_cli_process_config_cls(cls):
            base = super().get_cli_process_config_cls()

            class WithFlag(base):  # type: ignore[misc, valid-type]
                shout: bool = Field(False, description="An extra flag of this env.")

            return WithFlag

    parsed = parse_cli(Extra, ["process", "--shout", "true", "--env.group_size", "3"], "x")
    assert parsed.env_config.group_size == 3
    with pytest.raises(CliError, match="--shout"):
        parse_cli(Env, ["process", "--shout", "true"], "x")


def test_derived_batch_size_is_a_settable_property():
    env = _env()
    assert isinstance(inspect.getattr_static(BaseEnv, "derived_batch_size"), property)
    assert env.derived_batch_size == -1
    env.derived_batch_size = 12
    assert env.derived_batch_size == 12


def test_perf_stats_adds_to_the_given_dict():
    env = _env()
    env.task_duration = [1.0, 3.0]
    metrics = {"keep": 1}
    out = env.perf_stats(metrics)
    assert out is metrics and metrics["keep"] == 1
    assert metrics["train_perf/task_duration_mean"] == 2.0
    assert "train/items_sent_to_api" in metrics


async def test_post_json_with_compression_gzips_large_bodies():
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"ok": True})

    env = _env()
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        small = await env._post_json_with_compression(client, "http://x/s", {"a": 1})
        big_payload = {"tokens": [list(range(400))]}
        big = await env._post_json_with_compression(
            client, "http://x/b", big_payload, minimum_size=100
        )
    assert small.status_code == big.status_code == 200
    assert "content-encoding" not in seen[0].headers
    assert json.loads(seen[0].content) == {"a": 1}
    assert seen[1].headers["content-encoding"] == "gzip"
    assert json.loads(gzip.decompress(seen[1].content)) == big_payload


async def test_register_and_send_helpers_talk_to_the_api(monkeypatch):
    posted: list[tuple[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = request.content
        if request.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        posted.append((request.url.path, json.loads(body)))
        if request.url.path == "/register-env":
            return httpx.Response(200, json={"status": "success", "env_id": 3})
        if request.url.path == "/scored_data_list":
            return httpx.Response(422, json={"detail": "bad"})
        return httpx.Response(200, json={"status": "received"})

    from atroposlib.envs import api_client

    real = api_client.RolloutAPIClient

    def client(url: str, **kw: Any):
        return real(url, transport=httpx.MockTransport(handler))

    monkeypatch.setattr("atroposlib.envs.runner_api.RolloutAPIClient", client)
    env = _env()
    answer = await env._register_env()
    assert answer == {"status": "success", "env_id": 3}
    assert posted[0][1]["desired_name"] == "iface" and posted[0][1]["group_size"] == 2
    group = {"tokens": [[1, 2]], "masks": [[-100, 2]], "scores": [1.0]}
    await env._send_scored_data_to_api(group)
    assert posted[1] == ("/scored_data", group)
    with pytest.raises(RuntimeError, match="422"):
        await env._send_scored_data_to_api([group, group])


async def test_run_evaluate_alias(monkeypatch):
    env = _env()
    calls: list[str] = []

    async def fake(self):
        calls.append("run")

    monkeypatch.setattr(Env, "run_evaluate", fake)
    await env._run_evaluate()
    assert calls == ["run"]
