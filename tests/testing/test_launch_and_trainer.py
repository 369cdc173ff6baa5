"""``atroposlib.testing.launch`` and ``atroposlib.testing.trainer`` against the real servers:
the command lines start them, and the fake trainer receives what was posted, once."""

from __future__ import annotations

import httpx
import pytest

from atroposlib.cli.serve_model import build_parser as serve_model_parser
from atroposlib.testing.launch import fake_server_cmd, serve_model_cmd
from atroposlib.testing.ports import start_on_free_port
from atroposlib.testing.processes import stop_process
from atroposlib.testing.trainer import FakeTrainer, register_trainer, trainer_registration


def _group(first_token: int) -> dict:
    """A group of two sequences whose first token is ``first_token`` (its id)."""
    tokens = [[first_token, 5, 6], [first_token, 7, 8]]
    return {
        "tokens": tokens,
        "masks": [[-100, 5, 6], [-100, 7, 8]],
        "scores": [1.0, 0.0],
    }


@pytest.fixture
def api(rollout_api):
    """``(port, url)`` of the session's run-api, reset."""
    rollout_api.reset()
    return rollout_api.port, rollout_api.url


def test_fake_trainer_pulls_each_batch_once_and_acknowledges_it(api):
    port, url = api
    trainer = FakeTrainer(port, batch_size=4, num_steps=2)
    trainer.register()
    for first in (11, 12, 13, 14):
        r = httpx.post(f"{url}/scored_data", json=_group(first), timeout=10)
        assert r.status_code == 200, r.text
    assert trainer.queue_size() > 0
    trainer.drain(timeout=60)
    assert trainer.group_ids() == [11, 12, 13, 14]
    assert [sum(len(g["tokens"]) for g in b) for b in trainer.batches] == [4, 4]
    assert trainer.redelivered == 0 and trainer.pull_once() is False


def test_registration_body_takes_overrides():
    body = trainer_registration(8, num_steps=3, wandb_group="run-1")
    assert body["batch_size"] == 8 and body["num_steps"] == 3 and body["wandb_group"] == "run-1"
    assert body["save_checkpoint_interval"] == -1


def test_register_trainer_starts_the_run_so_an_env_may_register(api):
    _, url = api
    register_trainer(url, batch_size=4)
    env = {"max_token_length": 16, "desired_name": "e", "weight": 1.0, "group_size": 2}
    answer = httpx.post(f"{url}/register-env", json=env, timeout=10).json()
    assert answer.get("status") == "success", answer


def test_fake_server_cmd_starts_the_fake_inference_server(tmp_path):
    proc, port = start_on_free_port(
        lambda p: fake_server_cmd(p, "--latency-ms", "0"), log_path=tmp_path / "fake.log"
    )
    try:
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10)
        assert models.status_code == 200 and models.json()["data"]
    finally:
        stop_process(proc)


def test_serve_model_cmd_is_a_command_line_serve_model_accepts():
    cmd = serve_model_cmd("/models/tiny", 9123, "--seed", "0")
    assert cmd[1:3] == ["-m", "atroposlib.cli.serve_model"]
    args = serve_model_parser().parse_args(cmd[3:])
    assert (args.model, args.host, args.port, args.seed) == ("/models/tiny", "127.0.0.1", 9123, 0)
