"""Environments written for the original, run against vLLM's own server with
``--openai.server_type vllm``: groups with aligned tokens, masks and logprobs (``process``,
and ``serve`` with run-api and a trainer), the evaluation path, and the OpenAI proxy over ManagedServer sessions (streaming included)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from atroposlib.envs.cli import build_env, parse_cli
from atroposlib.testing.launch import run_api_cmd
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import running_process
from atroposlib.testing.proxy import running_proxy
from atroposlib.testing.trainer import register_trainer
from environments.arithmetic_server import ArithmeticEnv
from environments.blackjack_server import BlackjackEnv
from tests.environments.env_helpers import check_groups, process_argv, unmasked_runs
from tests.vllm.test_vllm_client import rescore

KEY = "vllm-proxy-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def serve(vllm_server) -> dict[str, str]:
    return {"base_url": vllm_server.base_url, "model": vllm_server.model_name}


def test_arithmetic_process_and_evaluate(vllm_server, tmp_path):
    out = tmp_path / "arithmetic.jsonl"
    argv = process_argv(serve(vllm_server), out, group_size=3, steps=2)
    asyncio.run(build_env(ArithmeticEnv, parse_cli(ArithmeticEnv, argv)).process_manager())
    groups = check_groups(out, 3, 2, 0.0, 1.0)
    # The recorded logprobs are vLLM's own for those tokens.
    tokens, masks = groups[0]["tokens"][0], groups[0]["masks"][0]
    start = masks.count(-100)
    again = rescore(vllm_server, tokens)[start:]
    recorded = groups[0]["inference_logprobs"][0][start:]
    assert max(abs(a - b) for a, b in zip(recorded, again, strict=True)) <= 1e-3

    argv = process_argv(serve(vllm_server), tmp_path / "unused.jsonl")
    argv[0] = "evaluate"
    argv += ["--env.data_dir_to_save_evals", str(tmp_path / "evals"), "--env.max_operand", "3"]
    asyncio.run(build_env(ArithmeticEnv, parse_cli(ArithmeticEnv, argv)).run_evaluate())
    metrics = json.loads((tmp_path / "evals" / "metrics.json").read_text())["results"]["all"]
    accuracy = [v for k, v in metrics.items() if k.startswith("eval/")]
    assert accuracy and all(0.0 <= v <= 1.0 for v in accuracy)


def test_blackjack_managed_server_groups_are_aligned(vllm_server, tmp_path):
    """A multi-turn environment on ManagedServer: one aligned sequence per game."""
    out = tmp_path / "blackjack.jsonl"
    argv = process_argv(
        serve(vllm_server),
        out,
        "--env.max_turns",
        "3",
        "--env.max_tokens_per_turn",
        "6",
        "--env.max_token_length",
        "512",
        "--env.on_invalid_action",
        "hit",
    )
    asyncio.run(build_env(BlackjackEnv, parse_cli(BlackjackEnv, argv)).process_manager())
    groups = check_groups(out, 2, 2, -1.0, 1.0)
    games = [
        (unmasked_runs(masks), sum(1 for m in messages if m["role"] == "assistant"))
        for group in groups
        for masks, messages in zip(group["masks"], group["messages"], strict=True)
    ]
    # A reply holding a special token (the random model samples them) is shown without it,
    # so the next turn starts a new sequence and the game keeps its longest: never more
    # trained spans than turns, and multi-turn games stay one sequence.
    assert all(1 <= runs <= turns for runs, turns in games), games
    if any(turns > 1 for _, turns in games):
        assert any(runs == turns > 1 for runs, turns in games), games


def test_proxy_plain_and_streamed_chat_over_vllm(vllm_server, tmp_path):
    servers = [
        {
            "base_url": vllm_server.base_url,
            "model_name": vllm_server.model_name,
            "server_type": "vllm",
            "timeout": 120,
        }
    ]
    with running_proxy(
        tmp_path,
        servers,
        tokenizer=vllm_server.model_name,
        model_name=vllm_server.model_name,
        api_key=KEY,
    ) as proxy:

        def session() -> str:
            r = httpx.post(f"{proxy.url}/sessions/create", json={}, headers=AUTH)
            assert r.status_code == 200, r.text
            return r.json()["uuid"]

        body = {
            "messages": [{"role": "user", "content": "Name three colors."}],
            "max_tokens": 6,
            "temperature": 0.0,
        }
        plain_sid, stream_sid = session(), session()
        plain = httpx.post(
            f"{proxy.url}/{plain_sid}/v1/chat/completions", json=body, headers=AUTH, timeout=120
        )
        assert plain.status_code == 200, plain.text
        streamed = httpx.post(
            f"{proxy.url}/{stream_sid}/v1/chat/completions",
            json={**body, "stream": True},
            headers=AUTH,
            timeout=120,
        )
        assert streamed.status_code == 200, streamed.text
        events = [e[len("data: ") :] for e in streamed.text.strip().split("\n\n")]
        assert events[-1] == "[DONE]"
        text = "".join(
            c["choices"][0]["delta"].get("content") or ""
            for c in map(json.loads, events[:-1])
            if c["choices"]
        )
        assert text == plain.json()["choices"][0]["message"]["content"]

        def nodes(sid: str) -> list[dict]:
            return httpx.get(f"{proxy.url}/{sid}/nodes", headers=AUTH).json()["nodes"]

        (plain_node,), (stream_node,) = nodes(plain_sid), nodes(stream_sid)
        assert plain_node["tokens"] == stream_node["tokens"]
        tokens, masked = plain_node["tokens"], plain_node["masked_tokens"]
        assert len(tokens) == len(masked) == len(plain_node["logprobs"])
        start = masked.count(-100)
        assert start and all(m == t for m, t in zip(masked[start:], tokens[start:], strict=True))
        again = rescore(vllm_server, tokens)[start:]
        recorded = plain_node["logprobs"][start:]
        assert max(abs(a - b) for a, b in zip(recorded, again, strict=True)) <= 1e-3


async def _serve_until_batch(env: ArithmeticEnv, api: str, polls: int) -> list:
    """Run the env's serve loop and poll ``/batch`` like a trainer until a batch arrives."""
    serving = asyncio.create_task(env.env_manager())
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            for _ in range(polls):
                if serving.done():
                    pytest.fail(f"the serve loop ended early: {serving.exception()!r}")
                batch = (await client.get(f"{api}/batch")).json().get("batch")
                if batch:
                    return batch
                await asyncio.sleep(0.5)
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
    pytest.fail(f"no batch after {polls} polls")


def test_arithmetic_serve_mode_batches_carry_vllms_weight_version(
    vllm_server, tmp_path, monkeypatch
):
    """``serve`` against run-api and a trainer: the groups reach a batch, aligned, with the
    policy version vLLM names (``/update_weight_version``, as a weight sync sets it)."""
    monkeypatch.setenv("ATROPOS_OUTBOX_DIR", str(tmp_path / "outbox"))
    api_port = free_port()
    api = f"http://127.0.0.1:{api_port}"
    argv = [
        "serve",
        "--env.rollout_server_url",
        api,
        "--env.group_size",
        "2",
        "--env.use_wandb",
        "false",
        "--env.steps_per_eval",
        "0",
        "--env.ensure_scores_are_not_same",
        "false",
        "--env.tokenizer_name",
        vllm_server.model_name,
        "--openai.base_url",
        vllm_server.base_url,
        "--openai.model_name",
        vllm_server.model_name,
        "--openai.server_type",
        "vllm",
        "--openai.timeout",
        "120",
    ]
    before = httpx.get(f"{vllm_server.url}/weight_info").json()["weight_version"]
    httpx.post(f"{vllm_server.url}/update_weight_version", json={"new_version": "3"})
    try:
        log = tmp_path / "api.log"
        with running_process(
            run_api_cmd(api_port), health_url=f"{api}/health", timeout=120, log_path=log
        ):
            register_trainer(api, batch_size=4, num_steps=10, first_batch=False, timeout=30)
            env = build_env(ArithmeticEnv, parse_cli(ArithmeticEnv, argv))
            batch = asyncio.run(_serve_until_batch(env, api, polls=600))
    finally:
        httpx.post(f"{vllm_server.url}/update_weight_version", json={"new_version": before})
    assert sum(len(g["tokens"]) for g in batch) == 4
    for group in batch:
        assert group["policy_version"] == [3, 3]
        for tokens, masks, logprobs in zip(
            group["tokens"], group["masks"], group["inference_logprobs"], strict=True
        ):
            assert len(tokens) == len(masks) == len(logprobs)
            assert any(m != -100 for m in masks)
            assert all(m == -100 or m == t for t, m in zip(tokens, masks, strict=True))
