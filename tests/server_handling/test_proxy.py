"""The managed-server proxy as a real process, and its client."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
import uvicorn

from atroposlib.envs.server_handling.managed_server_proxy import create_app, load_config
from atroposlib.envs.server_handling.proxy_client import ProxyManagedServer
from atroposlib.envs.server_handling.server_manager import ServerManager
from tests.helpers.procs import free_port, wait_http

USER = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def proxy(fake_pool, tokenizer, tmp_path_factory):
    """The proxy served by uvicorn in a thread (a process would re-import transformers)."""
    tmp = tmp_path_factory.mktemp("proxy")
    config = {
        "servers": [
            {
                "base_url": fake_pool[2].base_url,
                "server_type": "vllm",
                "model_name": "fake",
                "timeout": 10,
            },
            {
                "base_url": fake_pool[0].base_url,
                "server_type": "openai",
                "model_name": "fake",
                "timeout": 10,
            },
        ],
        "tool_parser": "hermes",
    }
    (tmp / "servers.json").write_text(json.dumps(config))
    servers, tok_name, tool_parser = load_config(str(tmp / "servers.json"))
    assert tok_name is None and tool_parser == "hermes"
    port = free_port()
    app = create_app(ServerManager(servers), tokenizer=tokenizer, tool_parser=tool_parser)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", timeout=30)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_health_models_and_servers(proxy):
    assert httpx.get(f"{proxy}/health").json() == {"status": "ok"}
    assert [m["id"] for m in httpx.get(f"{proxy}/v1/models").json()["data"]] == ["fake"]
    servers = httpx.get(f"{proxy}/servers").json()["servers"]
    assert [s["supports_tokens"] for s in servers] == [True, False]


async def test_openai_client_session_records_nodes_and_delete_ends_it(proxy, tokenizer):
    sid = httpx.post(f"{proxy}/sessions/create", json={}).json()["uuid"]
    client = openai.AsyncOpenAI(base_url=f"{proxy}/{sid}/v1", api_key="x", max_retries=0)
    completion = await client.chat.completions.create(
        model="fake", messages=USER, n=2, max_tokens=5
    )
    await client.close()
    assert len(completion.choices) == 2
    nodes = httpx.get(f"{proxy}/{sid}/nodes").json()["nodes"]
    assert len(nodes) == 2
    prompt_len = len(
        tokenizer.apply_chat_template(
            USER, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    for node in nodes:
        assert node["masked_tokens"][:prompt_len] == [-100] * prompt_len
        assert len(node["tokens"]) == len(node["logprobs"]) > prompt_len
    render = httpx.post(f"{proxy}/{sid}/v1/chat/completions/render", json={"messages": USER}).json()
    assert render["prompt"].endswith("assistant\n") and len(render["input_ids"]) == prompt_len
    assert any(s["uuid"] == sid for s in httpx.get(f"{proxy}/sessions").json()["sessions"])
    assert httpx.delete(f"{proxy}/{sid}").json() == {"deleted": sid}
    gone = httpx.get(f"{proxy}/{sid}/nodes")
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found_error"


def test_bad_requests_get_openai_errors_naming_the_field(proxy):
    sid = httpx.post(f"{proxy}/sessions/create", json={}).json()["uuid"]
    url = f"{proxy}/{sid}/v1/chat/completions"
    missing = httpx.post(url, json={"model": "fake"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "messages"
    bad_n = httpx.post(url, json={"messages": USER, "n": 0})
    assert bad_n.status_code == 400 and "n" in bad_n.json()["error"]["message"]
    not_json = httpx.post(url, content=b"{nope", headers={"content-type": "application/json"})
    assert not_json.status_code == 400 and "JSON" in not_json.json()["error"]["message"]
    stream = httpx.post(url, json={"messages": USER, "stream": True})
    assert stream.status_code == 400 and stream.json()["error"]["param"] == "stream"
    unknown = httpx.post(f"{proxy}/nope/v1/chat/completions", json={"messages": USER})
    assert unknown.status_code == 404
    openai_only = httpx.post(f"{proxy}/sessions/create", json={"base_url": "http://nowhere/v1"})
    assert openai_only.status_code == 404 and openai_only.json()["error"]["param"] == "base_url"
    extra = httpx.post(f"{proxy}/sessions/create", json={"colour": "red"})
    assert extra.status_code == 400 and extra.json()["error"]["param"] == "colour"


async def test_manager_proxy_mode_yields_proxy_sessions(proxy, monkeypatch):
    monkeypatch.setenv("ATROPOS_PROXY_URL", proxy)
    manager = ServerManager([], testing=True)
    async with manager.managed_server() as managed:
        assert isinstance(managed, ProxyManagedServer)
        completion = await managed.chat_completion(messages=USER, max_tokens=3)
        assert completion.choices
        assert len((await managed.aget_state())["nodes"]) == 1
        assert len(managed.get_state()["nodes"]) == 1
        managed.reset()
        assert (await managed.aget_state())["nodes"] == []
        sid = managed.session_id
    assert httpx.get(f"{proxy}/{sid}/nodes").status_code == 404


async def test_setup_configures_a_proxy_started_without_servers(fake_pool, tokenizer):
    app = create_app(tokenizer=tokenizer)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
        early = await client.post("/sessions/create", json={})
        assert early.status_code == 409
        bad = await client.post("/setup", json={"servers": []})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "servers"
        ok = await client.post(
            "/setup",
            json={
                "servers": [
                    {"base_url": fake_pool[1].base_url, "server_type": "vllm", "timeout": 10}
                ]
            },
        )
        assert ok.json() == {"status": "ok", "servers": 1}
        sid = (await client.post("/sessions/create", json={})).json()["uuid"]
        done = await client.post(f"/{sid}/v1/completions", json={"prompt": "abc", "max_tokens": 3})
        assert done.status_code == 200 and done.json()["choices"]
    await app.state.proxy.manager.close()
