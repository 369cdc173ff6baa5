"""``VLLMServer`` against vLLM's own server: tokens and logprobs from ``/v1/completions``
(``n``, ``max_tokens``, stop strings, finish reasons), ``get_logprobs`` from its prompt
logprobs, the policy version from its ``/weight_info``, the teacher path of
``TeacherDistillationEnv``, and the sampler's logprobs against vLLM's own re-score."""

from __future__ import annotations

import logging

import httpx
import pytest

from atroposlib.envs.base import ScoredDataGroup
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.server_handling.vllm_server import VLLMServer
from atroposlib.envs.teacher_distillation_env import TeacherDistillationConfig
from atroposlib.testing.vllm_server import RunningVLLM
from tests.envs.test_teacher_env import DistillEnv

PROMPT = [5, 6, 7, 8, 9, 10]


def config(server: RunningVLLM) -> APIServerConfig:
    return APIServerConfig(
        base_url=server.base_url,
        model_name=server.model_name,
        server_type="vllm",
        tokenizer_name=server.model_name,
        timeout=120,
    )


def rescore(server: RunningVLLM, ids: list[int]) -> list[float | None]:
    """vLLM's own logprob of each token of ``ids`` given the ones before (None for the first)."""
    body = {
        "model": server.model_name,
        "prompt": ids,
        "max_tokens": 1,
        "prompt_logprobs": 0,
        "temperature": 0.0,
    }
    answer = httpx.post(f"{server.base_url}/completions", json=body, timeout=120).json()
    rows = answer["choices"][0]["prompt_logprobs"]
    return [
        None if row is None else row[str(t)]["logprob"] for t, row in zip(ids, rows, strict=True)
    ]


def vllm_topk(server: RunningVLLM, ids: list[int], k: int) -> list[list[tuple[int, float]]]:
    """vLLM's own ``k`` best ``(id, logprob)`` at each position of ``ids`` after the first,
    in the order of its ``rank``."""
    body = {
        "model": server.model_name,
        "prompt": ids,
        "max_tokens": 1,
        "prompt_logprobs": k,
        "temperature": 0.0,
    }
    answer = httpx.post(f"{server.base_url}/completions", json=body, timeout=120).json()
    rows = answer["choices"][0]["prompt_logprobs"][1:]
    return [
        [
            (int(t), e["logprob"])
            for t, e in sorted(row.items(), key=lambda it: it[1]["rank"])
            if e["rank"] <= k
        ]
        for row in rows
    ]


def assert_topk(ids: list[list[int]], lps: list[list[float]], want: list) -> None:
    """``ids``/``lps`` (positions after the first) are vLLM's own best ``(id, logprob)``."""
    assert [[t for t, _ in row] for row in want] == ids
    for got, row in zip(lps, want, strict=True):
        assert got == pytest.approx([lp for _, lp in row], abs=1e-6)


async def test_tokens_n_max_tokens_stop_and_finish_reasons(vllm_server, caplog):
    server = VLLMServer(config(vllm_server))
    try:
        with caplog.at_level(logging.INFO, "atroposlib.envs.server_handling.vllm_server"):
            prompt, outs, lps, finish = await server.tokens_and_logprobs_completion(
                input_ids=PROMPT, n=3, max_tokens=5, temperature=1.0
            )
            await server.tokens_and_logprobs_completion(input_ids=PROMPT, max_tokens=1)
        probes = [r.getMessage() for r in caplog.records if "vLLM-type server" in r.getMessage()]
        assert len(probes) == 1, probes  # probed once, said once
        assert "/v1/completions" in probes[0] and "/weight_info" in probes[0]
        assert prompt == PROMPT and len(outs) == len(lps) == len(finish) == 3
        for ids, seq_lps, reason in zip(outs, lps, finish, strict=True):
            assert 1 <= len(ids) == len(seq_lps) <= 5
            assert all(lp <= 0.0 for lp in seq_lps)
            assert reason == ("length" if len(ids) == 5 else "stop")
        assert len({tuple(o) for o in outs}) > 1  # n samples, not one repeated

        # Greedy is deterministic: a stop string cut from its text ends the next one early.
        _, (greedy,), _, (why,) = await server.tokens_and_logprobs_completion(
            input_ids=PROMPT, max_tokens=8, temperature=0.0
        )
        assert why == "length" and len(greedy) == 8
        text = server.tokenizer.decode(greedy[3:5])
        _, (stopped,), _, (why,) = await server.tokens_and_logprobs_completion(
            input_ids=PROMPT, max_tokens=8, temperature=0.0, stop=[text]
        )
        assert why == "stop" and len(stopped) < 8 and stopped == greedy[: len(stopped)]
    finally:
        await server.close()


async def test_sampled_logprobs_equal_vllms_rescore(vllm_server):
    server = VLLMServer(config(vllm_server))
    try:
        _, outs, lps, _ = await server.tokens_and_logprobs_completion(
            input_ids=PROMPT, n=2, max_tokens=8, temperature=1.0
        )
    finally:
        await server.close()
    for ids, seq_lps in zip(outs, lps, strict=True):
        again = rescore(vllm_server, PROMPT + ids)[len(PROMPT) :]
        assert max(abs(a - b) for a, b in zip(seq_lps, again, strict=True)) <= 1e-3


async def test_get_logprobs_top_k_from_prompt_logprobs(vllm_server):
    server = VLLMServer(config(vllm_server))
    try:
        out = await server.get_logprobs(input_ids=PROMPT, top_k=3)
    finally:
        await server.close()
    assert out["prompt_tokens"] == PROMPT
    assert [len(r) for r in out["prompt_topk_token_ids"]] == [3] * len(PROMPT)
    want = vllm_topk(vllm_server, PROMPT, 3)
    assert_topk(out["prompt_topk_token_ids"][1:], out["prompt_topk_logprobs"][1:], want)


async def test_policy_version_is_vllms_weight_version(vllm_server):
    before = httpx.get(f"{vllm_server.url}/weight_info").json()["weight_version"]
    server = VLLMServer(config(vllm_server))
    try:
        result = await server.tokens_and_logprobs_completion(input_ids=PROMPT, max_tokens=2)
        assert result.policy_version is None  # "default": no step named yet
        r = httpx.post(f"{vllm_server.url}/update_weight_version", json={"new_version": "7"})
        assert r.status_code == 200, r.text
        result = await server.tokens_and_logprobs_completion(input_ids=PROMPT, max_tokens=2)
        assert result.policy_version == 7 and server.policy_version == 7
    finally:
        await server.close()
        httpx.post(f"{vllm_server.url}/update_weight_version", json={"new_version": before})


async def test_teacher_topk_comes_from_vllm(vllm_server):
    teacher = config(vllm_server)
    env = DistillEnv(
        TeacherDistillationConfig(
            wandb_name="distill",
            use_wandb=False,
            group_size=2,
            teacher_enabled=True,
            teacher_top_k=2,
            tokenizer_name=vllm_server.model_name,
        ),
        [APIServerConfig(base_url="http://127.0.0.1:9/v1", model_name="s", health_check=False)],
        teacher_server_configs=[teacher],
    )
    seqs = [PROMPT + [11, 12], PROMPT[:4]]
    g = ScoredDataGroup(tokens=seqs, masks=[list(s) for s in seqs], scores=[1.0, 0.0])
    await env.handle_send_to_api(g, do_send_to_api=False)
    await env.close_servers()
    assert [len(x) for x in g["distill_token_ids"]] == [len(s) for s in seqs]
    assert all(len(pos) == 2 for seq in g["distill_token_ids"] for pos in seq)
    for seq, ids, lps in zip(seqs, g["distill_token_ids"], g["distill_logprobs"], strict=True):
        assert_topk(ids[1:], lps[1:], vllm_topk(vllm_server, seq, 2))


async def test_chat_and_completion_use_vllms_openai_routes(vllm_server):
    """What evaluation code calls: ``chat_completion`` and ``completion`` with ``n``."""
    server = VLLMServer(config(vllm_server))
    try:
        chat = await server.chat_completion(
            messages=[{"role": "user", "content": "2+2="}], n=2, max_tokens=3
        )
        text = await server.completion(prompt="Once upon", max_tokens=3, temperature=0.0)
    finally:
        await server.close()
    assert len(chat.choices) == 2 and all(c.finish_reason for c in chat.choices)
    assert len(text.choices) == 1 and text.choices[0].finish_reason in ("length", "stop")
