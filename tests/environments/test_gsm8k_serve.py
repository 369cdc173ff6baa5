"""gsm8k in ``serve`` mode: a real run-api, a fake trainer, the env process and the
tiny model; scored groups with tokens, masks and inference logprobs reach a batch."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx

from tests.environments.env_helpers import write_jsonl
from tests.helpers.procs import free_port, running_process

ROOT = Path(__file__).resolve().parents[2]


def test_gsm8k_serve_sends_groups_that_a_trainer_receives(serve_model, tmp_path):
    api_port = free_port()
    api = f"http://127.0.0.1:{api_port}"
    data = write_jsonl(tmp_path / "gsm8k.jsonl", [{"question": "What is 2 + 3?", "answer": "#### 5"},
                                                   {"question": "What is 4 - 1?", "answer": "#### 3"}])
    api_cmd = [sys.executable, "-m", "atroposlib.cli.run_api", "--host", "127.0.0.1", "--port", str(api_port)]
    env_cmd = [sys.executable, str(ROOT / "environments" / "gsm8k_server.py"), "serve",
               "--env.rollout_server_url", api, "--env.data_path", str(data), "--env.group_size", "2",
               "--env.max_token_length", "16", "--env.use_wandb", "false", "--env.steps_per_eval", "0",
               "--env.ensure_scores_are_not_same", "false", "--env.tokenizer_name", serve_model["model"],
               "--openai.base_url", serve_model["base_url"], "--openai.model_name", serve_model["model"],
               "--openai.server_type", "vllm"]
    with running_process(api_cmd, health_url=f"{api}/health", log_path=tmp_path / "api.log"):
        register = {"wandb_group": "g", "wandb_project": "p", "batch_size": 4, "max_token_len": 4096,
                    "checkpoint_dir": "", "save_checkpoint_interval": -1, "starting_step": 0, "num_steps": 10}
        httpx.post(f"{api}/register", json=register, timeout=10).raise_for_status()
        httpx.get(f"{api}/batch", timeout=10).raise_for_status()
        with running_process(env_cmd, log_path=tmp_path / "env.log") as env_proc:
            deadline = time.monotonic() + 120
            batch = None
            while batch is None and time.monotonic() < deadline:
                assert env_proc.poll() is None, (tmp_path / "env.log").read_text()[-3000:]
                batch = httpx.get(f"{api}/batch", timeout=10).json().get("batch")
                time.sleep(0.5)
    assert batch is not None, (tmp_path / "env.log").read_text()[-3000:]
    assert sum(len(g["tokens"]) for g in batch) == 4
    for group in batch:
        assert len(group["tokens"]) == 2 and group["env_id"] is not None
        for tokens, masks, logprobs in zip(group["tokens"], group["masks"], group["inference_logprobs"],
                                           strict=True):
            assert len(tokens) == len(masks) == len(logprobs)
            assert any(m != -100 for m in masks)
        assert all(s in (-1.0, 1.0) or 0.0 <= s <= 1.0 for s in group["scores"])
