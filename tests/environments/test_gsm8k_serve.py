"""gsm8k in ``serve`` mode: a real run-api, a trainer polling ``/batch``, the tiny model
behind a real ``atropos-serve-model``, and the environment's serve loop; scored groups
with tokens, masks and inference logprobs reach a batch."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, List

import httpx
import pytest

from atroposlib.envs.cli import build_env, parse_cli
from atroposlib.testing.launch import run_api_cmd as api_cmd
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import running_process
from atroposlib.testing.trainer import register_trainer
from environments.gsm8k_server import GSM8kEnv
from tests.environments.env_helpers import write_jsonl


async def _serve_until_batch(env: GSM8kEnv, api: str, timeout_s: float) -> List[Any]:
    """Run the env's serve loop and poll ``/batch`` like a trainer until a batch arrives."""
    serving = asyncio.create_task(env.env_manager())
    last_error = None
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            while loop.time() < deadline:
                if serving.done():
                    pytest.fail(f"the serve loop ended early: {serving.exception()!r}")
                try:
                    batch = (await client.get(f"{api}/batch")).json().get("batch")
                except httpx.HTTPError as err:  # a slow answer on a loaded machine: poll again
                    batch, last_error = None, err
                if batch:
                    return batch
                await asyncio.sleep(0.5)
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
    pytest.fail(f"no batch within {timeout_s}s (last error: {last_error})")


def test_gsm8k_serve_sends_groups_that_a_trainer_receives(serve_model, tmp_path, monkeypatch):
    monkeypatch.setenv("ATROPOS_OUTBOX_DIR", str(tmp_path / "outbox"))
    api_port = free_port()
    api = f"http://127.0.0.1:{api_port}"
    data = write_jsonl(
        tmp_path / "gsm8k.jsonl",
        [
            {"question": "What is 2 + 3?", "answer": "#### 5"},
            {"question": "What is 4 - 1?", "answer": "#### 3"},
        ],
    )
    argv = [
        "serve",
        "--env.rollout_server_url",
        api,
        "--env.data_path",
        str(data),
        "--env.group_size",
        "2",
        "--env.max_token_length",
        "16",
        "--env.use_wandb",
        "false",
        "--env.steps_per_eval",
        "0",
        "--env.ensure_scores_are_not_same",
        "false",
        "--env.tokenizer_name",
        serve_model["model"],
        "--openai.base_url",
        serve_model["base_url"],
        "--openai.model_name",
        serve_model["model"],
        "--openai.server_type",
        "vllm",
    ]
    log = tmp_path / "api.log"
    with running_process(api_cmd(api_port), health_url=f"{api}/health", timeout=120, log_path=log):
        register_trainer(api, batch_size=4, num_steps=10, first_batch=False, timeout=30)
        env = build_env(GSM8kEnv, parse_cli(GSM8kEnv, argv))
        batch = asyncio.run(_serve_until_batch(env, api, timeout_s=180))
    assert sum(len(g["tokens"]) for g in batch) == 4, Path(log).read_text()[-2000:]
    for group in batch:
        assert len(group["tokens"]) == 2 and group["env_id"] is not None
        for tokens, masks, logprobs in zip(
            group["tokens"], group["masks"], group["inference_logprobs"], strict=True
        ):
            assert len(tokens) == len(masks) == len(logprobs)
            assert any(m != -100 for m in masks)
            assert all(m == -100 or m == t for t, m in zip(tokens, masks, strict=True))
        assert all(-1.0 <= s <= 1.0 for s in group["scores"])
    assert env.iter >= 2
