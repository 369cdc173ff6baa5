"""``atroposlib.testing.proxy.running_proxy``: the proxy process the proxy tests share."""

from __future__ import annotations

import json

import httpx

from atroposlib.testing.proxy import running_proxy
from atroposlib.tiny_model import load_tiny_tokenizer


def test_running_proxy_writes_its_config_saves_the_tokenizer_and_stops_after_the_block(
    tmp_path,
):
    servers = [{"base_url": "http://127.0.0.1:9/v1", "server_type": "vllm"}]
    with running_proxy(
        tmp_path,
        {"servers": servers, "tool_parser": "hermes"},
        "--max-sessions",
        "1",
        tokenizer=load_tiny_tokenizer(),
        model_name="named-model",
        api_key="k",
    ) as proxy:
        assert proxy.url == f"http://127.0.0.1:{proxy.port}"
        health = httpx.get(f"{proxy.url}/health").json()
        assert health["model"] == "named-model"
        auth = {"Authorization": "Bearer k"}
        assert httpx.post(f"{proxy.url}/sessions/create", json={}).status_code == 401
        first = httpx.post(f"{proxy.url}/sessions/create", json={}, headers=auth)
        assert first.status_code == 200, first.text
        second = httpx.post(f"{proxy.url}/sessions/create", json={}, headers=auth)
        assert second.status_code == 429  # --max-sessions 1 reached the proxy
    assert proxy.proc.poll() is not None
    written = json.loads((tmp_path / "servers.json").read_text())
    assert written == {"servers": servers, "tool_parser": "hermes"}
    assert (tmp_path / "tok" / "tokenizer_config.json").exists()
    assert proxy.log == tmp_path / "proxy.log" and proxy.log.exists()
