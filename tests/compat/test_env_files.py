"""Environment files written in the original's style, run unchanged as real processes.

Each file in this folder is what a user of the original has in their checkout: a
config subclass returned by ``config_init()`` without ``env_config_cls``, an env
that tokenises with ``apply_chat_template`` itself, an env whose
``collect_trajectories`` raises. They run in ``process`` and ``serve`` mode against
the real ``run-api`` and ``atropos-serve-model`` (tiny model).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import httpx
import pytest

from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import start_process, stop_process, wait_http
from atroposlib.testing.trainer import FakeTrainer
from tests.envs.serve_helpers import env_cmd, fake_server_cmd

HERE = Path(__file__).resolve().parent
WORD_GAME = HERE / "word_game_env.py"
CHAT_TEMPLATE = HERE / "chat_template_env.py"
RAISING = HERE / "raising_env.py"


def server_flags(serve: Dict[str, str]) -> List[str]:
    return [
        "--env.tokenizer_name",
        serve["model"],
        "--openai.base_url",
        serve["base_url"],
        "--openai.model_name",
        serve["model"],
        "--openai.timeout",
        "120",
    ]


def clean_env(tmp_path: Path, **extra: str) -> Dict[str, str]:
    """The test's environment minus W&B credentials and with an empty HOME."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("WANDB_") and k not in ("PYTHONPATH", "ATROPOS_API_KEY")
    }
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env.update(HOME=str(home), PYTHONUNBUFFERED="1", ATROPOS_OUTBOX_DIR=str(tmp_path / "outbox"))
    env.update(extra)
    return env


def run_env(
    cmd: List[str], tmp_path: Path, timeout: float = 240, **env: str
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *cmd],
        cwd=tmp_path,
        env=clean_env(tmp_path, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def groups_in(path: Path) -> List[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def assert_int_lists(group: dict) -> None:
    for field in ("tokens", "masks"):
        assert isinstance(group[field], list)
        for seq in group[field]:
            assert isinstance(seq, list) and seq, (field, seq)
            assert all(type(v) is int for v in seq), (field, seq[:5])
    assert all(len(t) == len(m) for t, m in zip(group["tokens"], group["masks"], strict=True))


def wait_exit(proc: subprocess.Popen, timeout: float, log: Path) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_process(proc)
        raise AssertionError(f"env did not finish:\n{log.read_text()[-3000:]}") from None


# ---------------------------------------------------------------- process mode


def test_config_subclass_env_process_uses_its_fields_and_runs_without_a_wandb_login(
    tmp_path, serve_model
):
    words = tmp_path / "words.txt"
    words.write_text("zebra\nquartz\n")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"env:\n  dictionary_path: {words}\n  task_name: yaml-task\n")
    out = tmp_path / "groups.jsonl"
    proc = run_env(
        [
            str(WORD_GAME),
            "process",
            "--config",
            str(cfg),
            "--env.debug_mode",
            "true",
            "--env.starting_level",
            "5",
            "--env.data_path_to_save_groups",
            str(out),
            *server_flags(serve_model),
        ],
        tmp_path,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "[yaml-task] debug: item zebra at level 5" in log
    assert "[yaml-task] debug: item quartz at level 5" in log
    groups = groups_in(out)
    assert len(groups) == 2
    for group in groups:
        assert_int_lists(group)
    # process mode turns W&B on as the original does; without a login it runs offline
    assert log.count("W&B is not configured") == 1, log[-4000:]
    assert (tmp_path / "wandb").is_dir()
    assert "make sure it is running" not in log  # the probe found the server


def test_chat_template_tokens_are_written_as_int_lists(tmp_path, serve_model):
    from transformers import AutoTokenizer

    out = tmp_path / "groups.jsonl"
    proc = run_env(
        [
            str(CHAT_TEMPLATE),
            "process",
            "--env.use_wandb",
            "false",
            "--env.data_path_to_save_groups",
            str(out),
            *server_flags(serve_model),
        ],
        tmp_path,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert not (tmp_path / "wandb").exists()  # --env.use_wandb false still disables W&B
    groups = groups_in(out)
    assert len(groups) == 2
    tok = AutoTokenizer.from_pretrained(serve_model["model"])
    for group in groups:
        assert_int_lists(group)
        text = tok.decode(group["tokens"][0])
        assert "input_ids" not in text
        assert f"{group['messages'][0][0]['content']}" in text


def test_raising_env_process_stops_after_max_consecutive_failures(tmp_path, serve_model):
    proc = run_env(  # the timeout is a hang guard; the failure count bounds the run
        [str(RAISING), "process", "--env.use_wandb", "false", *server_flags(serve_model)],
        tmp_path,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    attempts = proc.stderr.count("collect_trajectories failed")
    assert 20 <= attempts <= 20 + 8, attempts  # the limit, plus items already in flight
    assert "last failure:" in proc.stderr
    assert "ValueError: broken reward parser" in proc.stderr
    summary = proc.stderr.strip().splitlines()[-1]
    assert summary.startswith("raising_env.py: error: 20 consecutive failures; stopping")
    assert "collect_trajectories" in summary


def test_no_reachable_server_exits_2_naming_the_url(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}/v1"
    proc = run_env(  # the timeout is a hang guard
        [str(WORD_GAME), "process", "--openai.base_url", dead, "--env.use_wandb", "false"],
        tmp_path,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"no inference server reachable: {dead} (connection refused)" in proc.stderr
    assert "atropos-serve-model" in proc.stderr


# ------------------------------------------------------------------ serve mode


@pytest.fixture
def api(rollout_api) -> int:
    """The port of the session's run-api, reset (no trainer, no envs, empty queue)."""
    rollout_api.reset()
    return rollout_api.port


def serve_cmd(env_file: Path, api_port: int, serve: Dict[str, str], *extra: str) -> List[str]:
    return [
        sys.executable,
        str(env_file),
        "serve",
        "--env.rollout_server_url",
        f"http://127.0.0.1:{api_port}",
        *server_flags(serve),
        *extra,
    ]


def test_serve_mode_waits_for_a_trainer_then_sends_int_lists(tmp_path, api, serve_model):
    log = tmp_path / "env.log"
    env = start_process(
        serve_cmd(CHAT_TEMPLATE, api, serve_model, "--env.total_steps", "2"),
        log_path=log,
        env=clean_env(tmp_path, WANDB_MODE="disabled"),
    )
    try:
        deadline = time.monotonic() + 60
        notice = f"waiting for a trainer to register at http://127.0.0.1:{api} (POST /register)"
        while notice not in log.read_text() and time.monotonic() < deadline:
            assert env.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        assert log.read_text().count(notice) == 1
        trainer = FakeTrainer(api, batch_size=2, num_steps=2)
        trainer.register()
        trainer.start()
        assert wait_exit(env, 180, log) == 0, log.read_text()[-3000:]
        trainer.stop()
        trainer.drain()
    finally:
        stop_process(env)
    batches = [g for batch in trainer.batches for g in batch]
    assert batches, log.read_text()[-3000:]
    for group in batches:
        assert_int_lists(group)


def test_config_subclass_env_serves(tmp_path, api, serve_model):
    log = tmp_path / "env.log"
    trainer = FakeTrainer(api, batch_size=2, num_steps=2)
    trainer.register()
    trainer.start()
    env = start_process(
        serve_cmd(WORD_GAME, api, serve_model, "--env.debug_mode", "true"),
        log_path=log,
        env=clean_env(tmp_path, WANDB_MODE="disabled"),
    )
    try:
        assert wait_exit(env, 180, log) == 0, log.read_text()[-3000:]
    finally:
        stop_process(env)
        trainer.stop()
    assert "[word_game] debug: item apple at level 3" in log.read_text()
    assert trainer.batches


def test_raising_env_serve_stops_with_an_error(tmp_path, api, serve_model):
    log = tmp_path / "env.log"
    trainer = FakeTrainer(api, batch_size=2, num_steps=5)
    trainer.register()
    env = start_process(
        serve_cmd(RAISING, api, serve_model, "--env.max_consecutive_failures", "6"),
        log_path=log,
        env=clean_env(tmp_path, WANDB_MODE="disabled"),
    )
    try:
        code = wait_exit(env, 120, log)
    finally:
        stop_process(env)
    text = log.read_text()
    assert code == 1, text[-3000:]
    assert "6 consecutive failures; stopping" in text
    assert "ValueError: broken reward parser" in text
    assert httpx.get(f"http://127.0.0.1:{api}/status", timeout=5).json()["queue_size"] == 0


def test_env_stops_after_max_server_downtime_when_its_server_goes_away(tmp_path):
    port = free_port()
    log = tmp_path / "env.log"
    fake = start_process(fake_server_cmd(port, latency_ms=20), log_path=tmp_path / "fake.log")
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc=fake)
        out = tmp_path / "g.jsonl"
        env = start_process(
            env_cmd(
                "process",
                None,
                port,
                "--env.total_steps",
                "1000000",
                "--env.max_server_downtime",
                "2",
                "--env.data_path_to_save_groups",
                str(out),
            ),
            log_path=log,
            env=clean_env(tmp_path, WANDB_MODE="disabled"),
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (
            not out.exists() or len(out.read_text().splitlines()) < 3
        ):
            assert env.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)
        stop_process(fake)
        code = wait_exit(env, 60, log)  # a hang guard: it gives up after --env.max_server_downtime
    finally:
        stop_process(fake)
    text = log.read_text()
    assert code == 1, text[-3000:]
    assert "no inference server answering" in text
    assert "every inference server has been unreachable" in text


def test_serve_waits_for_a_missing_inference_server_then_gives_up(tmp_path, api):
    log = tmp_path / "env.log"
    trainer = FakeTrainer(api, batch_size=2, num_steps=2)
    trainer.register()
    dead = f"http://127.0.0.1:{free_port()}/v1"
    env = start_process(
        [
            sys.executable,
            str(WORD_GAME),
            "serve",
            "--env.rollout_server_url",
            f"http://127.0.0.1:{api}",
            "--openai.base_url",
            dead,
            "--env.max_server_downtime",
            "1",
        ],
        log_path=log,
        env=clean_env(tmp_path, WANDB_MODE="disabled"),
    )
    try:
        code = wait_exit(env, 60, log)
    finally:
        stop_process(env)
    text = log.read_text()
    assert code == 1, text[-3000:]
    assert f"no inference server answering for 0 s ({dead}: connection refused)" in text
    assert "every inference server has been unreachable" in text
