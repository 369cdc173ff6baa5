"""``process`` and ``evaluate`` subcommands against a real fake-inference-server process.

The environment runs in the test process through ``run_cli`` (the same code path as
``python env.py process ...``); ``test_cli`` covers running the script itself.
"""

from __future__ import annotations

import json
import logging

import pytest
import yaml

from atroposlib.envs.cli import run_cli
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import running_process

from .serve_helpers import env_cmd, fake_server_cmd
from .trivial_env import TrivialEnv


@pytest.fixture(scope="module")
def inference_port(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("fake") / "fake.log"
    with running_process(
        fake_server_cmd(port, latency_ms=1),
        health_url=f"http://127.0.0.1:{port}/health",
        log_path=log,
    ):
        yield port


def run(cmd, cwd, monkeypatch):
    """Run ``env_cmd(...)`` in-process in ``cwd``; returns the exit code and captured log text."""
    monkeypatch.chdir(cwd)
    argv = cmd[2:] + ["--env.use_wandb", "false"]
    try:
        run_cli(TrivialEnv, argv)
    except SystemExit as exc:
        return exc.code
    return 0


def test_process_writes_n_groups_to_jsonl_and_html(tmp_path, inference_port, monkeypatch):
    out = tmp_path / "out" / "groups.jsonl"
    proc = run(
        env_cmd(
            "process",
            None,
            inference_port,
            "--env.total_steps",
            "5",
            "--env.group_size",
            "2",
            "--env.data_path_to_save_groups",
            str(out),
        ),
        tmp_path,
        monkeypatch,
    )
    assert proc == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 5
    assert all(len(g["tokens"]) == 2 and g["messages"] for g in lines)
    assert len({g["tokens"][0][0] for g in lines}) == 5
    html = out.with_suffix(".html")
    assert html.exists() and "Group" in html.read_text()


def test_process_default_path_and_no_overwrite(tmp_path, inference_port, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "trivial.jsonl").write_text("earlier run\n")
    proc = run(
        env_cmd("process", None, inference_port, "--env.total_steps", "2"), tmp_path, monkeypatch
    )
    assert proc == 0
    assert (tmp_path / "data" / "trivial.jsonl").read_text() == "earlier run\n"
    assert len((tmp_path / "data" / "trivial_1.jsonl").read_text().splitlines()) == 2


def test_process_stops_when_items_run_out(tmp_path, inference_port, monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    out = tmp_path / "g.jsonl"
    proc = run(
        env_cmd(
            "process",
            None,
            inference_port,
            "--env.total_steps",
            "50",
            "--env.max_items",
            "3",
            "--env.data_path_to_save_groups",
            str(out),
        ),
        tmp_path,
        monkeypatch,
    )
    assert proc == 0
    assert len(out.read_text().splitlines()) == 3
    assert "ran out after 3 of 50" in caplog.text


def test_evaluate_writes_metrics_samples_and_config(tmp_path, inference_port, monkeypatch):
    evals = tmp_path / "evals"
    proc = run(
        env_cmd(
            "evaluate",
            None,
            inference_port,
            "--env.data_dir_to_save_evals",
            str(evals),
            "--env.group_size",
            "3",
        ),
        tmp_path,
        monkeypatch,
    )
    assert proc == 0
    metrics = json.loads((evals / "metrics.json").read_text())
    assert metrics["results"]["all"]["eval/score"] == 0.5
    assert "atropos|trivial_eval|0" in metrics["results"]
    assert (evals / "samples.jsonl").read_text().strip()
    config = yaml.safe_load((evals / "evaluate_config.yaml").read_text())
    assert config["env"]["group_size"] == 3
    assert config["openai"][0]["base_url"] == f"http://127.0.0.1:{inference_port}/v1"
