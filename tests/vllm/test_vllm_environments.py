"""Environments written for the original, run against vLLM's own server with
``--openai.server_type vllm``: groups with aligned tokens, masks and logprobs (``process``),
the evaluation path, and the OpenAI proxy over ManagedServer sessions (streaming included)."""

from __future__ import annotations

import asyncio
import json

import httpx

from atroposlib.envs.cli import build_env, parse_cli
from atroposlib.testing.proxy import running_proxy
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
