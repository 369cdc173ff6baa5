"""The full serve loop with real processes: run-api, a fake inference server, the env, a trainer.

Each group the env produces carries a unique id; the tests check that every one
reaches exactly one trainer batch (or is still queued, less than one batch), also
across an API restart with ``--persist`` and a period of 503 answers.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from atroposlib.testing.launch import run_api_cmd as api_cmd
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import running_process, start_process, stop_process, wait_http
from atroposlib.testing.trainer import FakeTrainer

from .serve_helpers import env_cmd, fake_server_cmd, produced_ids

GROUP_SIZE = 4
BATCH_SIZE = 8


@pytest.fixture(scope="module")
def inference_port(tmp_path_factory):
    port = free_port()
    with running_process(
        fake_server_cmd(port, latency_ms=5),
        health_url=f"http://127.0.0.1:{port}/health",
        log_path=tmp_path_factory.mktemp("fake") / "fake.log",
    ):
        yield port


def wait_exit(proc: subprocess.Popen, timeout: float, log: Path) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_process(proc)
        raise AssertionError(
            f"env did not finish in {timeout}s:\n{log.read_text()[-3000:]}"
        ) from None


def assert_exactly_once(trainer: FakeTrainer, jsonl: Path, env_log: Path) -> list:
    produced = produced_ids(jsonl)
    batched = trainer.group_ids()
    assert len(set(produced)) == len(produced), "env produced a group id twice"
    dupes = [gid for gid, n in Counter(batched).items() if n > 1]
    assert not dupes, f"groups served twice: {dupes}"
    assert set(batched) <= set(produced)
    leftover = set(produced) - set(batched)
    queued = trainer.queue_size()
    assert len(leftover) == queued, (
        f"{len(leftover)} produced groups never reached a batch but {queued} are queued\n"
        + env_log.read_text()[-3000:]
    )
    assert queued * GROUP_SIZE < BATCH_SIZE
    return produced


def test_every_group_reaches_exactly_one_batch(tmp_path, inference_port):
    api_port = free_port()
    jsonl = tmp_path / "groups.jsonl"
    env_log = tmp_path / "env.log"
    with running_process(
        api_cmd(api_port),
        health_url=f"http://127.0.0.1:{api_port}/health",
        log_path=tmp_path / "api.log",
    ):
        trainer = FakeTrainer(api_port, BATCH_SIZE, num_steps=6)
        trainer.register()
        trainer.start()
        env = start_process(
            env_cmd(
                "serve",
                api_port,
                inference_port,
                "--env.total_steps",
                "6",
                "--env.data_path_to_save_groups",
                str(jsonl),
                "--env.max_num_workers",
                "8",
            ),
            log_path=env_log,
            env={"ATROPOS_OUTBOX_DIR": str(tmp_path / "outbox")},
        )
        assert wait_exit(env, 90, env_log) == 0
        assert "enough data queued for total_steps=6" in env_log.read_text()
        trainer.drain()
        assert len(trainer.batches) >= 6
        # A second env run, stopped with SIGTERM mid-run, still delivers what it produced.
        env = start_process(
            env_cmd(
                "serve",
                api_port,
                inference_port,
                "--env.total_steps",
                "100000",
                "--env.data_path_to_save_groups",
                str(jsonl),
                "--env.max_num_workers",
                "8",
                "--env.id_offset",
                "1000000",
                "--env.max_batches_offpolicy",
                "0",
            ),
            log_path=env_log,
            env={"ATROPOS_OUTBOX_DIR": str(tmp_path / "outbox")},
        )
        deadline = time.monotonic() + 60
        while (
            time.monotonic() < deadline
            and sum(1 for gid in trainer.group_ids() if gid > 1000000)
            < 2 * BATCH_SIZE // GROUP_SIZE
        ):
            time.sleep(0.1)
        env.send_signal(signal.SIGTERM)
        assert wait_exit(env, 90, env_log) == 0
        assert "stop requested" in env_log.read_text()
        trainer.stop()
        trainer.drain()
        produced = assert_exactly_once(trainer, jsonl, env_log)
        assert any(gid > 1000000 for gid in produced)
        status = httpx.get(f"http://127.0.0.1:{api_port}/status", timeout=5).json()
        assert status["current_step"] == len(trainer.batches)
    assert not (tmp_path / "outbox").exists() or not any((tmp_path / "outbox").rglob("*.json"))


def test_no_group_lost_across_503_and_a_persisted_api_restart(tmp_path, inference_port):
    api_port = free_port()
    db = tmp_path / "api.db"
    jsonl = tmp_path / "groups.jsonl"
    env_log = tmp_path / "env.log"
    # ~16 KB per group (4 x 500 tokens, tokens + masks): 0.06 MiB holds only a few groups.
    cmd = api_cmd(api_port, "--persist", str(db), "--max-queue-mb", "0.06")
    health = f"http://127.0.0.1:{api_port}/health"
    api = start_process(cmd, log_path=tmp_path / "api.log")
    env = None
    try:
        wait_http(health, timeout=60, proc=api)
        trainer = FakeTrainer(api_port, BATCH_SIZE, num_steps=8)
        trainer.register()
        trainer.paused.set()
        trainer.start()
        env = start_process(
            env_cmd(
                "serve",
                api_port,
                inference_port,
                "--env.total_steps",
                "8",
                "--env.data_path_to_save_groups",
                str(jsonl),
                "--env.max_num_workers",
                "4",
                "--env.max_batches_offpolicy",
                "0",
                "--env.seq_len",
                "500",
            ),
            log_path=env_log,
            env={"ATROPOS_OUTBOX_DIR": str(tmp_path / "outbox")},
        )
        deadline = time.monotonic() + 60
        while "busy (503)" not in env_log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "busy (503)" in env_log.read_text(), "the API never answered 503"
        trainer.paused.clear()
        while len(trainer.batches) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        # Restart the API mid-run on the same database.
        stop_process(api)
        time.sleep(1.0)
        api = start_process(cmd, log_path=tmp_path / "api.log")
        wait_http(health, timeout=60, proc=api)
        assert wait_exit(env, 120, env_log) == 0
        trainer.stop()
        trainer.drain()
        assert_exactly_once(trainer, jsonl, env_log)
        assert len(trainer.batches) >= 8
    finally:
        if env is not None:
            stop_process(env)
        stop_process(api)
