"""Environments written for the original, run against vLLM's own server with
``--openai.server_type vllm``: groups with aligned tokens, masks and logprobs (``process``,
and ``serve`` with run-api and a trainer; a multi-turn game among them), multi-turn
ManagedServer sequences whose replies hold special tokens, the evaluation path, and the OpenAI
proxy over ManagedServer sessions (streaming included)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from atroposlib.envs.cli import build_env, parse_cli
from atroposlib.envs.server_handling.managed_server import ManagedServer
from atroposlib.envs.server_handling.vllm_server import VLLMServer
from atroposlib.testing.launch import run_api_cmd
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import running_process
from atroposlib.testing.proxy import running_proxy
from atroposlib.testing.trainer import register_trainer
from environments.arithmetic_server import ArithmeticEnv
from environments.blackjack_server import BlackjackEnv
from tests.environments.env_helpers import check_groups, process_argv, unmasked_runs
from tests.vllm.test_vllm_client import config as vllm_config
from tests.vllm.test_vllm_client import rescore

KEY = "vllm-proxy-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Short games (3 turns of 6 tokens) that go on after an unreadable action.
BLACKJACK_FLAGS = (
    "--env.max_turns",
    "3",
    "--env.max_tokens_per_turn",
    "6",
    "--env.max_token_length",
    "512",
    "--env.on_invalid_action",
    "hit",
)


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
    argv = process_argv(serve(vllm_server), out, *BLACKJACK_FLAGS)
    asyncio.run(build_env(BlackjackEnv, parse_cli(BlackjackEnv, argv)).process_manager())
    groups = check_groups(out, 2, 2, -1.0, 1.0)
    games = [
        (unmasked_runs(masks), sum(1 for m in messages if m["role"] == "assistant"))
        for group in groups
        for masks, messages in zip(group["masks"], group["messages"], strict=True)
    ]
    # Every turn of a game is a trained span of its one sequence.
    assert all(runs == turns for runs, turns in games), games
    assert any(turns > 1 for _, turns in games), games
    for group in groups:  # the logprobs of every turn are vLLM's own for those tokens
        for tokens, masks, recorded in zip(
            group["tokens"], group["masks"], group["inference_logprobs"], strict=True
        ):
            again = rescore(vllm_server, tokens)
            pairs = [(r, a) for r, a, m in zip(recorded, again, masks, strict=True) if m != -100]
            assert max(abs(r - a) for r, a in pairs) <= 1e-3


async def test_managed_server_turns_after_a_reply_with_special_tokens_stay_one_sequence(
    vllm_server,
):
    """A reply holding a special token reaches the environment without it, and the next
    turn is rendered from that text: the conversation stays one sequence, the sampled tokens
    verbatim, every turn trained, and the logprobs vLLM's own for those tokens."""
    server = VLLMServer(vllm_config(vllm_server))
    try:
        tok = server.tokenizer
        im_start = tok.convert_tokens_to_ids("<|im_start|>")
        managed = ManagedServer(server, tok)
        messages = [{"role": "user", "content": "Deal the cards."}]
        # A bias makes <|im_start|> likely (the logprobs stay the raw model's): of 8
        # replies, take one that has it before its last token.
        first = await managed.chat_completion(
            messages=messages, n=8, max_tokens=6, temperature=1.0, logit_bias={im_start: 7.0}
        )
        nodes = managed.get_state()["nodes"]
        pick = next(
            i
            for i, node in enumerate(nodes)
            if im_start in node.tokens[-6:-1] and node.metadata["finish_reason"] == "length"
        )
        picked = nodes[pick]
        reply = first.choices[pick].message.content
        assert "<|im_start|>" not in reply
        for turn in ("You hit: 17.", "The dealer shows 9."):
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": turn}]
            out = await managed.chat_completion(messages=messages, max_tokens=6, temperature=1.0)
            reply = out.choices[0].message.content
        nodes = managed.get_state()["nodes"]
    finally:
        await server.close()
    assert len(nodes) == 8  # the picked conversation continued its node, none was added
    node = nodes[pick]
    assert node.tokens[: len(picked.tokens)] == picked.tokens  # sampled tokens verbatim
    assert node.masked_tokens[: len(picked.tokens)] == picked.masked_tokens
    assert unmasked_runs(node.masked_tokens) == 3
    again = rescore(vllm_server, node.tokens)
    masks = node.masked_tokens
    trained = [(r, a) for r, a, m in zip(node.logprobs, again, masks, strict=True) if m != -100]
    assert len(trained) >= 8 and max(abs(r - a) for r, a in trained) <= 1e-3


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


async def _serve_until_batch(env: ArithmeticEnv | BlackjackEnv, api: str, polls: int) -> list:
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


@pytest.mark.parametrize(
    "env_cls, flags",
    [(ArithmeticEnv, ()), (BlackjackEnv, BLACKJACK_FLAGS)],
    ids=["arithmetic", "blackjack"],
)
def test_serve_mode_batches_are_aligned_and_carry_vllms_weight_version(
    vllm_server, tmp_path, monkeypatch, env_cls, flags
):
    """``serve`` against run-api and a trainer (a one-turn and a multi-turn environment): the
    groups reach a batch with the tokens, masks and logprobs vLLM sampled, and the policy
    version vLLM names (``/update_weight_version``, as a weight sync sets it)."""
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
        *flags,
    ]
    before = httpx.get(f"{vllm_server.url}/weight_info").json()["weight_version"]
    httpx.post(f"{vllm_server.url}/update_weight_version", json={"new_version": "3"})
    try:
        log = tmp_path / "api.log"
        with running_process(
            run_api_cmd(api_port), health_url=f"{api}/health", timeout=120, log_path=log
        ):
            register_trainer(api, batch_size=4, num_steps=10, first_batch=False, timeout=30)
            env = build_env(env_cls, parse_cli(env_cls, argv))
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
            again = rescore(vllm_server, tokens)
            pairs = [(r, a) for r, a, m in zip(logprobs, again, masks, strict=True) if m != -100]
            assert max(abs(r - a) for r, a in pairs) <= 1e-3
        for masks, messages in zip(group["masks"], group.get("messages") or [], strict=False):
            assert unmasked_runs(masks) == sum(1 for m in messages if m["role"] == "assistant")
