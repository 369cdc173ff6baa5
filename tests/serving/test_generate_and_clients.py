"""The vLLM-style ``/generate`` endpoint, with the project's VLLMServer and ManagedServer
as clients; token ids and logprobs must match a direct forward pass."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.serving.support import direct_logprobs, direct_prompt_logprobs, post

QUESTION = "Emma buys 4 cakes at $3 each. How much money does Emma spend?"


@pytest.mark.smoke
def test_generate_returns_tokens_logprobs_and_finish_reasons(served, local_model, tokenizer):
    prompt_ids = tokenizer.encode(QUESTION)
    body = post(
        f"{served.url}/generate",
        {
            "prompt": {"prompt_token_ids": prompt_ids},
            "n": 3,
            "max_tokens": 9,
            "logprobs": 0,
            "seed": 4,
            "ignore_eos": True,
        },
    ).json()
    assert body["prompt_token_ids"] == prompt_ids
    assert len(body["text"]) == len(body["token_ids"]) == len(body["logprobs"]) == 3
    assert body["finish_reasons"] == ["length"] * 3
    for text, ids, lps in zip(body["text"], body["token_ids"], body["logprobs"], strict=True):
        assert len(ids) == 9 and len(lps) == 9
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        got = []
        for pos, entry in enumerate(lps):
            assert len(entry) == 1  # logprobs=0: the sampled token only
            ((tid, lp),) = entry[0].items()
            assert int(tid) == ids[pos]
            got.append(lp)
        want = direct_logprobs(local_model, prompt_ids, ids)
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4


def test_generate_with_text_prompt_and_top_alternatives(served, tokenizer):
    body = post(
        f"{served.url}/generate", {"prompt": QUESTION, "max_tokens": 4, "logprobs": 2}
    ).json()
    assert body["prompt"] == QUESTION
    assert body["prompt_token_ids"] == tokenizer.encode(QUESTION)
    for entry in body["logprobs"][0]:
        assert 1 <= len(entry) <= 3
        lps = [next(iter(d.values())) for d in entry[1:]]
        assert lps == sorted(lps, reverse=True)


def test_prompt_logprobs_match_direct_forward_pass(served, local_model, tokenizer):
    prompt_ids = tokenizer.encode(QUESTION)
    body = post(
        f"{served.url}/generate",
        {
            "prompt": {"prompt_token_ids": prompt_ids},
            "prompt_logprobs": 2,
            "max_tokens": 1,
            "temperature": 0,
        },
    ).json()
    plp = body["prompt_logprobs"]
    assert len(plp) == len(prompt_ids) and plp[0] is None
    want = direct_prompt_logprobs(local_model, prompt_ids)
    got = [entry[str(tok)] for entry, tok in zip(plp[1:], prompt_ids[1:], strict=True)]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
    assert all(2 <= len(entry) <= 3 for entry in plp[1:])


def _vllm_server(served, tiny_model_dir):
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig
    from atroposlib.envs.server_handling.vllm_server import VLLMServer

    cfg = APIServerConfig(
        base_url=served.v1,
        model_name="tiny",
        tokenizer_name=str(tiny_model_dir),
        api_key="x",
        timeout=60,
        server_type="vllm",
    )
    return VLLMServer(cfg)


async def test_vllm_server_client_tokens_and_logprobs_match_forward(
    served, tiny_model_dir, local_model, tokenizer
):
    server = _vllm_server(served, tiny_model_dir)
    try:
        prompt_ids = tokenizer.encode(QUESTION)
        prompt, outs, lps, finish = await server.tokens_and_logprobs_completion(
            input_ids=prompt_ids, n=2, max_tokens=6, temperature=1.0
        )
        assert prompt == prompt_ids and len(outs) == len(lps) == len(finish) == 2
        for ids, got in zip(outs, lps, strict=True):
            assert 1 <= len(ids) <= 6 and len(got) == len(ids)
            want = direct_logprobs(local_model, prompt_ids, ids)
            assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
        res = await server.get_logprobs(input_ids=prompt_ids, top_k=3)
        assert res["prompt_tokens"] == prompt_ids
        assert len(res["prompt_topk_token_ids"]) == len(prompt_ids)
        assert all(len(row) == 3 for row in res["prompt_topk_logprobs"])
        chat = await server.chat_completion(
            messages=[{"role": "user", "content": QUESTION}], max_tokens=3, n=2
        )
        assert len(chat.choices) == 2
    finally:
        await server.close_http() if hasattr(server, "close_http") else None


async def test_managed_server_tracks_tokens_masks_and_logprobs(
    served, tiny_model_dir, local_model, tokenizer
):
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig
    from atroposlib.envs.server_handling.server_manager import ServerManager

    cfg = APIServerConfig(
        base_url=served.v1,
        model_name="tiny",
        tokenizer_name=str(tiny_model_dir),
        api_key="x",
        timeout=60,
        server_type="vllm",
        health_check=False,
    )
    manager = ServerManager([cfg])
    messages = [{"role": "user", "content": QUESTION}]
    async with manager.managed_server(tokenizer=tokenizer) as managed:
        completion = await managed.chat_completion(messages=messages, n=2, max_tokens=5)
        nodes = managed.get_state()["nodes"]
    assert len(completion.choices) == 2 and len(nodes) == 2
    prompt_ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    for node in nodes:
        n_prompt = len(prompt_ids)
        assert node.tokens[:n_prompt] == prompt_ids
        out_ids = node.tokens[n_prompt:]
        assert 1 <= len(out_ids) <= 5
        assert node.masked_tokens[:n_prompt] == [-100] * n_prompt
        assert node.masked_tokens[n_prompt:] == out_ids
        want = direct_logprobs(local_model, prompt_ids, out_ids)
        got = node.logprobs[n_prompt:]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4


async def test_concurrent_requests_share_forward_passes(served):
    """16 concurrent 24-token requests need far fewer steps than 16 x 24 sequential ones."""
    async with httpx.AsyncClient(timeout=60) as client:
        for _ in range(300):  # steps run while anything runs: start from an idle engine
            health = (await client.get(f"{served.url}/health")).json()
            if health["running"] == 0 and health["waiting"] == 0:
                break
            await asyncio.sleep(0.1)
        before = health["steps"]
        bodies = [
            {"prompt": f"request {i}", "max_tokens": 24, "ignore_eos": True} for i in range(16)
        ]
        rs = await asyncio.gather(*(client.post(f"{served.url}/generate", json=b) for b in bodies))
        after = (await client.get(f"{served.url}/health")).json()["steps"]
    assert all(r.status_code == 200 for r in rs)
    assert all(len(r.json()["token_ids"][0]) == 24 for r in rs)
    assert after - before < 16 * 24 / 4


def test_abandoned_request_stops_generating(served):
    """A client that times out frees its batch rows instead of leaving 20k tokens to run."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{served.url}/generate",
            timeout=1.0,
            json={"prompt": "x", "max_tokens": 20000, "ignore_eos": True},
        )
    deadline = time.monotonic() + 15
    health = {}
    while time.monotonic() < deadline:
        health = httpx.get(f"{served.url}/health", timeout=10).json()
        if health["running"] == 0 and health["waiting"] == 0:
            break
        time.sleep(0.2)
    assert health["running"] == 0 and health["waiting"] == 0


def test_repetition_penalty_changes_greedy_output_but_not_logprobs(served, local_model, tokenizer):
    prompt_ids = tokenizer.encode(QUESTION)
    body = {
        "prompt": {"prompt_token_ids": prompt_ids},
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
    }
    plain = post(f"{served.url}/generate", body).json()["token_ids"][0]
    r = post(f"{served.url}/generate", {**body, "repetition_penalty": 3.0}).json()
    ids = r["token_ids"][0]
    assert ids != plain
    assert len(set(ids)) == len(ids)  # a strong penalty avoids every repeat here
    got = [next(iter(e[0].values())) for e in r["logprobs"][0]]
    want = direct_logprobs(local_model, prompt_ids, ids)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
