"""VLLMServer and ManagedServer against the embedded ``atropos-serve-model`` (tiny model).

Slow (it loads torch and a model): runs only with ``ATROPOS_RUN_SLOW=1``.
"""

from __future__ import annotations

import os

import pytest

from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.server_handling.server_manager import ServerManager
from atroposlib.testing.launch import serve_model_cmd
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import running_process

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("ATROPOS_RUN_SLOW") != "1", reason="set ATROPOS_RUN_SLOW=1"),
]


async def test_vllm_backend_and_managed_server_against_embedded_server(
    tiny_model_dir, tokenizer, tmp_path
):
    port = free_port()
    cmd = serve_model_cmd(tiny_model_dir, port)
    with running_process(
        cmd,
        health_url=f"http://127.0.0.1:{port}/health",
        timeout=180,
        log_path=tmp_path / "serve.log",
    ):
        manager = ServerManager(
            [
                APIServerConfig(
                    base_url=f"http://127.0.0.1:{port}/v1",
                    model_name=str(tiny_model_dir),
                    server_type="vllm",
                    timeout=120,
                )
            ]
        )
        try:
            ids = tokenizer.encode("hello world", add_special_tokens=False)
            prompt, outs, lps, finish = await manager.tokens_and_logprobs_completion(
                input_ids=ids, n=2, max_tokens=5
            )
            assert prompt == ids and len(outs) == 2
            assert all(len(o) == len(lp) for o, lp in zip(outs, lps, strict=True))
            assert all(x <= 0 for lp in lps for x in lp) and len(finish) == 2
            top = await manager.get_logprobs(input_ids=ids, top_k=2)
            assert [len(r) for r in top["prompt_topk_logprobs"]] == [2] * len(ids)
            async with manager.managed_server(tokenizer=tokenizer) as managed:
                await managed.chat_completion(
                    messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=6
                )
                nodes = managed.get_state()["nodes"]
                assert len(nodes) == 2
                assert all(len(n.tokens) == len(n.masked_tokens) == len(n.logprobs) for n in nodes)
            chat = await manager.chat_completion(
                messages=[{"role": "user", "content": "hi"}], n=10, max_tokens=4
            )
            assert [c.index for c in chat.choices] == list(range(10))
        finally:
            await manager.close()
