"""The session's vLLM server is vLLM's own, and has the routes the tests rely on."""

from __future__ import annotations

import httpx

from atroposlib.testing.vllm_server import RunningVLLM


def test_vllm_serves_token_prompts_and_dev_routes(vllm_server: RunningVLLM) -> None:
    body = {
        "model": vllm_server.model_name,
        "prompt": [5, 6, 7],
        "max_tokens": 3,
        "n": 2,
        "logprobs": 0,
        "return_token_ids": True,
    }
    answer = httpx.post(f"{vllm_server.base_url}/completions", json=body, timeout=120).json()
    assert [len(c["token_ids"]) for c in answer["choices"]] == [3, 3]
    assert all(len(c["logprobs"]["token_logprobs"]) == 3 for c in answer["choices"])
    info = httpx.get(f"{vllm_server.url}/weight_info", timeout=30)
    assert info.status_code == 200 and "weight_version" in info.json()
    version = httpx.get(f"{vllm_server.url}/version", timeout=30).json()["version"]
    assert version.startswith("0.32")
    # The original's patched server's route is not vLLM's.
    assert httpx.post(f"{vllm_server.url}/generate", json={}, timeout=30).status_code == 404
