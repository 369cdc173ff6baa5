"""Backends against real fake-server processes on loopback."""

from __future__ import annotations

import pytest

from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.server_handling.server_manager import ServerManager
from atroposlib.envs.server_handling.sglang_server import SGLangServer
from atroposlib.envs.server_handling.vllm_server import VLLMServer

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


def _cfg(server, **kw) -> APIServerConfig:
    return APIServerConfig(base_url=server.base_url, model_name="fake", timeout=10, **kw)


async def test_chat_completion_n_above_max_is_split_and_choices_renumbered(fake_pool):
    manager = ServerManager([_cfg(s) for s in fake_pool], max_n_completions=2)
    try:
        completion = await manager.chat_completion(messages=MESSAGES, n=5, max_tokens=8)
        assert [c.index for c in completion.choices] == [0, 1, 2, 3, 4]
        assert all(c.message.content for c in completion.choices)
    finally:
        await manager.close()


async def test_completion_through_manager_returns_n_texts(fake_pool):
    manager = ServerManager([_cfg(fake_pool[0])], max_n_completions=8)
    try:
        completion = await manager.completion(prompt="Once upon", n=3, max_tokens=6)
        assert len(completion.choices) == 3
        assert all(1 <= len(c.text) <= 6 for c in completion.choices)
    finally:
        await manager.close()


async def test_bare_api_server_config_means_one_server_at_its_base_url(fake_pool):
    manager = ServerManager(_cfg(fake_pool[1]))
    try:
        assert [s.config.base_url for s in manager.servers] == [fake_pool[1].base_url]
        before = fake_pool[1].stats()["requests"].get("/v1/chat/completions", 0)
        await manager.chat_completion(messages=MESSAGES, max_tokens=4)
        after = fake_pool[1].stats()["requests"].get("/v1/chat/completions", 0)
        assert after == before + 1
    finally:
        await manager.close()


async def test_openai_server_discovers_ignored_n_and_sends_separate_requests(fake_pool):
    srv = fake_pool[2]
    srv.configure(ignore_n=True)
    manager = ServerManager([_cfg(srv)])
    try:
        completion = await manager.chat_completion(messages=MESSAGES, n=3, max_tokens=4)
        assert [c.index for c in completion.choices] == [0, 1, 2]
        assert manager.servers[0].config.n_kwarg_is_ignored is True
        completion = await manager.completion(prompt="x", n=2, max_tokens=4)
        assert len(completion.choices) == 2
    finally:
        srv.configure(ignore_n=False)
        await manager.close()


async def test_vllm_tokens_and_logprobs_parse_generate_output(fake_pool):
    manager = ServerManager([_cfg(fake_pool[0], server_type="vllm")])
    try:
        assert isinstance(manager.servers[0], VLLMServer)
        prompt, outs, lps, finish = await manager.tokens_and_logprobs_completion(
            input_ids=[10, 11, 12], n=3, max_new_tokens=7, temperature=1.0
        )
        assert prompt == [10, 11, 12]
        assert len(outs) == len(lps) == len(finish) == 3
        for ids, lp, fr in zip(outs, lps, finish, strict=False):
            assert 1 <= len(ids) <= 7 and len(ids) == len(lp)
            assert all(x <= 0 for x in lp)
            assert fr == ("length" if len(ids) == 7 else "stop")
        again = await manager.tokens_and_logprobs_completion(
            input_ids=[10, 11, 12], n=3, max_tokens=7
        )
        assert again[1] == outs  # the fake server is deterministic
    finally:
        await manager.close()


async def test_vllm_tokens_n_above_max_concatenates_chunks(fake_pool):
    manager = ServerManager([_cfg(s, server_type="vllm") for s in fake_pool], max_n_completions=2)
    try:
        prompt, outs, lps, finish = await manager.tokens_and_logprobs_completion(
            input_ids=[1, 2], n=5, max_tokens=3
        )
        assert len(outs) == len(lps) == len(finish) == 5
    finally:
        await manager.close()


async def test_vllm_get_logprobs_returns_pos_by_k_lists(fake_pool):
    manager = ServerManager([_cfg(fake_pool[0], server_type="vllm")])
    try:
        out = await manager.get_logprobs(input_ids=[5, 6, 7, 8], top_k=3)
        assert out["prompt_tokens"] == [5, 6, 7, 8]
        assert [len(r) for r in out["prompt_topk_token_ids"]] == [3, 3, 3, 3]
        assert [len(r) for r in out["prompt_topk_logprobs"]] == [3, 3, 3, 3]
        for pos in range(1, 4):  # the real token is the best one at each position
            assert out["prompt_topk_token_ids"][pos][0] == out["prompt_tokens"][pos]
            assert out["prompt_topk_logprobs"][pos] == sorted(
                out["prompt_topk_logprobs"][pos], reverse=True
            )
    finally:
        await manager.close()


async def test_vllm_text_prompt_is_tokenized_and_duplicate_bos_removed(fake_pool, tokenizer):
    server = VLLMServer(_cfg(fake_pool[0], server_type="vllm"))
    server.tokenizer = tokenizer
    try:
        prompt, outs, _, _ = await server.tokens_and_logprobs_completion(
            prompt="hello", max_tokens=2
        )
        assert prompt == tokenizer.encode("hello")

        class Bos:
            bos_token_id = 99

        server.tokenizer = Bos()
        prompt, _, _, _ = await server.tokens_and_logprobs_completion(
            input_ids=[99, 99, 5], max_tokens=2
        )
        assert prompt == [99, 5]
    finally:
        await server.close()


async def test_sglang_tokens_and_logprobs_parse_meta_info(fake_pool):
    manager = ServerManager([_cfg(fake_pool[2], server_type="sglang")])
    try:
        assert isinstance(manager.servers[0], SGLangServer)
        prompt, outs, lps, finish = await manager.tokens_and_logprobs_completion(
            input_ids=[3, 4], n=2, max_tokens=5
        )
        assert prompt == [3, 4]
        assert len(outs) == 2 and all(len(o) == len(lp) for o, lp in zip(outs, lps, strict=False))
        assert set(finish) <= {"stop", "length"}
    finally:
        await manager.close()


async def test_trl_server_decodes_completion_ids_and_sets_finish_reason(fake_pool, tokenizer):
    manager = ServerManager(
        [
            APIServerConfig(
                base_url=fake_pool[0].url,  # TRL's vllm-serve has no /v1 prefix
                server_type="trl",
                timeout=10,
            )
        ]
    )
    manager.servers[0].tokenizer = tokenizer
    try:
        completion = await manager.chat_completion(messages=MESSAGES, n=2, max_tokens=4)
        assert len(completion.choices) == 2
        assert all(c.finish_reason == "length" for c in completion.choices)
        completion = await manager.completion(prompt="abc", max_tokens=3)
        assert len(completion.choices) == 1
    finally:
        await manager.close()


async def test_openai_server_cannot_give_tokens(fake_pool):
    manager = ServerManager([_cfg(fake_pool[0])])
    try:
        with pytest.raises(NotImplementedError):
            await manager.tokens_and_logprobs_completion(input_ids=[1], max_tokens=2)
    finally:
        await manager.close()


async def test_bad_request_is_not_retried_and_names_field(fake_pool):
    import openai

    manager = ServerManager([_cfg(fake_pool[0])])
    try:
        before = fake_pool[0].stats()["requests"].get("/v1/chat/completions", 0)
        with pytest.raises(openai.UnprocessableEntityError) as exc:
            await manager.chat_completion(messages=[])
        assert "messages" in str(exc.value)
        assert fake_pool[0].stats()["requests"]["/v1/chat/completions"] == before + 1
        assert manager.servers[0].server_healthy
    finally:
        await manager.close()


async def test_sglang_get_logprobs_reads_input_top_logprobs(fake_pool):
    manager = ServerManager([_cfg(fake_pool[2], server_type="sglang")])
    try:
        out = await manager.get_logprobs(input_ids=[4, 5, 6], top_k=2)
        assert out["prompt_tokens"] == [4, 5, 6]
        assert [len(r) for r in out["prompt_topk_token_ids"]] == [2, 2, 2]
        assert out["prompt_topk_token_ids"][1][0] == 5 and out["prompt_topk_token_ids"][2][0] == 6
    finally:
        await manager.close()


def test_fake_server_rejects_bad_input_with_field_names(fake_pool):
    import httpx

    url = fake_pool[0].url
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": []})
    assert r.status_code == 422 and "messages" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/generate", json={"prompt": {"prompt_token_ids": [1]}, "max_tokens": 0})
    assert r.status_code == 422 and "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/generate", content=b"[1,", headers={"content-type": "application/json"})
    assert r.status_code == 400
    r = httpx.post(f"{url}/generate", json=[1, 2])
    assert r.status_code == 422
    r = httpx.post(f"{url}/fake/config", json={"fail_status": 200})
    assert r.status_code == 422 and "fail_status" in r.json()["error"]["message"]
    r = httpx.post(
        f"{url}/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": "x"}}
    )
    assert r.status_code == 422 and "max_new_tokens" in r.json()["error"]["message"]
