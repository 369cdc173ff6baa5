"""BaseEnv stamps every group with the weight version the inference server reported."""

from __future__ import annotations

import json

import httpx

from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import running_process

from .serve_helpers import env_cmd, fake_server_cmd
from .test_process_evaluate import run


def test_process_output_carries_the_servers_policy_version(tmp_path, monkeypatch):
    port = free_port()
    with running_process(
        fake_server_cmd(port, latency_ms=1),
        health_url=f"http://127.0.0.1:{port}/health",
        log_path=tmp_path / "fake.log",
    ):
        r = httpx.post(f"http://127.0.0.1:{port}/fake/config", json={"policy_version": 4})
        assert r.status_code == 200
        out = tmp_path / "groups.jsonl"
        code = run(
            env_cmd(
                "process",
                None,
                port,
                "--env.total_steps",
                "3",
                "--env.group_size",
                "2",
                "--env.data_path_to_save_groups",
                str(out),
            ),
            tmp_path,
            monkeypatch,
        )
    assert code == 0
    groups = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(groups) == 3
    assert all(g["policy_version"] == [4, 4] for g in groups)
    assert all("policy_version_max" not in g for g in groups)
    assert "policy v4" in out.with_suffix(".html").read_text()


def test_env_knows_when_a_rollout_is_already_too_stale():
    from .test_base_hooks import make_env

    env = make_env()
    assert env.latest_policy_version is None and env.is_too_stale(0) is False
    env.status_dict = {"current_step": 5, "current_version": 5}
    assert env.latest_policy_version == 5 and env.is_too_stale(1) is False  # no bound set
    env.status_dict = {"current_version": 5, "max_staleness": 2}
    assert env.is_too_stale(2) is True
    assert env.is_too_stale(3) is False
    assert env.is_too_stale(None) is False
