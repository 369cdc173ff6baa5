"""The managed-server proxy: as a real process (auth, browser guard, errors), and its app
built the original's way (``create_app(server_manager, tokenizer, model_name)``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from atroposlib.envs.server_handling.managed_server_proxy import UpstreamPolicy, create_app
from atroposlib.envs.server_handling.proxy_client import ProxyManagedServer
from atroposlib.envs.server_handling.server_harness import ServerHarness
from atroposlib.envs.server_handling.server_manager import ServerManager
from atroposlib.testing.proxy import running_proxy
from tests.fake_servers import fake_servers

USER = [{"role": "user", "content": "Name a color."}]
KEY = "proxy-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@dataclass
class Proxy:
    url: str
    log: Path
    failing: object  # the FakeServer sessions can be pinned to for upstream errors


@pytest.fixture(scope="module")
def proxy(fake_pool, tokenizer, tmp_path_factory):
    """The proxy process, keyed through ATROPOS_API_KEY, over two vLLM-style fakes and an
    OpenAI-only one; the second fake is this module's own, made to fail on demand."""
    tmp = tmp_path_factory.mktemp("proxy")
    with fake_servers(1, "--latency-ms", "1") as (failing,):
        config = {
            "servers": [
                {"base_url": fake_pool[2].base_url, "server_type": "vllm", "timeout": 10},
                {
                    "base_url": failing.base_url,
                    "server_type": "vllm",
                    "timeout": 10,
                    "health_check": False,
                },
                {"base_url": fake_pool[0].base_url, "server_type": "openai", "timeout": 10},
            ],
            "tool_parser": "hermes",
        }
        with running_proxy(
            tmp,
            config,
            "--allow-upstream",
            "gpu-node.internal:9001",
            tokenizer=tokenizer,
            model_name="fake-model",
            api_key=KEY,
        ) as running:
            yield Proxy(running.url, running.log, failing)


def test_health_is_open_and_every_other_path_needs_the_key(proxy):
    health = httpx.get(f"{proxy.url}/health")
    assert health.status_code == 200
    assert health.json()["status"] == "ok" and health.json()["model"] == "fake-model"
    for method, path in [
        ("GET", "/sessions"),
        ("GET", "/v1/models"),
        ("GET", "/servers"),
        ("POST", "/sessions/create"),
        ("POST", "/setup"),
        ("DELETE", "/some-session"),
    ]:
        r = httpx.request(method, f"{proxy.url}{path}", json={})
        assert r.status_code == 401, (method, path, r.text)
    wrong = httpx.get(f"{proxy.url}/sessions", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    models = httpx.get(f"{proxy.url}/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == ["fake-model"]
    servers = httpx.get(f"{proxy.url}/servers", headers=AUTH).json()["servers"]
    assert [s["supports_tokens"] for s in servers] == [True, True, False]


async def test_openai_client_session_records_nodes_and_delete_ends_it(proxy, tokenizer):
    created = httpx.post(f"{proxy.url}/sessions/create", json={}, headers=AUTH).json()
    sid = created["uuid"]
    assert created["model_name"] == "fake-model"
    assert created["base_url"] == f"{proxy.url}/{sid}/v1"
    client = openai.AsyncOpenAI(base_url=created["base_url"], api_key=KEY, max_retries=0)
    completion = await client.chat.completions.create(
        model="fake", messages=USER, n=2, max_tokens=5
    )
    assert (await client.models.list()).data[0].id == "fake-model"
    await client.close()
    assert len(completion.choices) == 2 and completion.model == "fake-model"
    nodes = httpx.get(f"{proxy.url}/{sid}/nodes", headers=AUTH).json()["nodes"]
    assert len(nodes) == 2
    prompt_len = len(
        tokenizer.apply_chat_template(
            USER, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    for node in nodes:
        assert node["masked_tokens"][:prompt_len] == [-100] * prompt_len
        assert len(node["tokens"]) == len(node["logprobs"]) > prompt_len
    render = httpx.post(
        f"{proxy.url}/{sid}/v1/chat/completions/render", json={"messages": USER}, headers=AUTH
    ).json()
    assert render["prompt_text"].endswith("assistant\n") and len(render["token_ids"]) == prompt_len
    assert render["num_tokens"] == prompt_len
    listed = httpx.get(f"{proxy.url}/sessions", headers=AUTH).json()["sessions"]
    assert [s["num_nodes"] for s in listed if s["uuid"] == sid] == [2]
    deleted = httpx.delete(f"{proxy.url}/{sid}", headers=AUTH)
    assert deleted.json() == {"status": "deleted", "uuid": sid}
    gone = httpx.get(f"{proxy.url}/{sid}/nodes", headers=AUTH)
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found_error"
    no_route = httpx.get(f"{proxy.url}/a/b/c/d", headers=AUTH)
    assert no_route.status_code == 404 and no_route.json()["error"]["code"] == 404


def test_bad_requests_get_openai_4xx_naming_the_field(proxy):
    sid = httpx.post(f"{proxy.url}/sessions/create", json={}, headers=AUTH).json()["uuid"]
    url = f"{proxy.url}/{sid}/v1/chat/completions"

    def post(body):
        return httpx.post(url, json=body, headers=AUTH)

    missing = post({"model": "fake"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "messages"
    bad_n = post({"messages": USER, "n": 0})
    assert bad_n.status_code == 400 and bad_n.json()["error"]["param"] == "n"
    for field, value in [("max_tokens", 0), ("temperature", -1), ("top_p", 2), ("seed", 2**64)]:
        r = post({"messages": USER, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
    no_role = post({"messages": [{"content": "hi"}]})
    assert no_role.status_code == 400 and no_role.json()["error"]["param"] == "messages.0.role"
    not_json = httpx.post(
        url, content=b"{nope", headers={**AUTH, "content-type": "application/json"}
    )
    assert not_json.status_code == 400 and "JSON" in not_json.json()["error"]["message"]
    stream = post({"messages": USER, "stream": "yes"})
    assert stream.status_code == 400 and stream.json()["error"]["param"] == "stream"
    unknown = httpx.post(
        f"{proxy.url}/nope/v1/chat/completions", json={"messages": USER}, headers=AUTH
    )
    assert unknown.status_code == 404
    no_server = httpx.post(
        f"{proxy.url}/sessions/create", json={"base_url": "http://nowhere/v1"}, headers=AUTH
    )
    assert no_server.status_code == 404 and no_server.json()["error"]["param"] == "base_url"
    extra = httpx.post(f"{proxy.url}/sessions/create", json={"colour": "red"}, headers=AUTH)
    assert extra.status_code == 400 and extra.json()["error"]["param"] == "colour"


def test_an_inference_servers_4xx_stays_a_4xx_and_its_5xx_is_a_502(proxy):
    pinned = httpx.post(
        f"{proxy.url}/sessions/create", json={"base_url": proxy.failing.base_url}, headers=AUTH
    ).json()["uuid"]
    url = f"{proxy.url}/{pinned}/v1/chat/completions"
    try:
        proxy.failing.configure(fail_status=422)
        refused = httpx.post(url, json={"messages": USER, "max_tokens": 3}, headers=AUTH)
        assert refused.status_code == 422, refused.text
        assert "inference server refused" in refused.json()["error"]["message"]
        proxy.failing.configure(fail_status=500)
        broken = httpx.post(url, json={"messages": USER, "max_tokens": 3}, headers=AUTH, timeout=60)
        assert broken.status_code == 502 and broken.json()["error"]["type"] == "upstream_error"
    finally:
        proxy.failing.configure(fail_status=None)
    ok = httpx.post(url, json={"messages": USER, "max_tokens": 3}, headers=AUTH)
    assert ok.status_code == 200


def test_browser_requests_are_refused(proxy):
    foreign = httpx.get(f"{proxy.url}/sessions", headers={**AUTH, "Origin": "https://evil.example"})
    assert foreign.status_code == 403
    rebound = httpx.get(f"{proxy.url}/sessions", headers={**AUTH, "Host": "evil.example"})
    assert rebound.status_code == 403
    text_plain = httpx.post(
        f"{proxy.url}/sessions/create",
        content=b"{}",
        headers={**AUTH, "Content-Type": "text/plain"},
    )
    assert text_plain.status_code == 415


async def test_manager_proxy_mode_yields_proxy_sessions_with_the_key(proxy, monkeypatch):
    monkeypatch.setenv("ATROPOS_PROXY_URL", proxy.url)
    monkeypatch.setenv("ATROPOS_API_KEY", KEY)
    manager = ServerManager([], testing=True)
    async with manager.managed_server() as managed:
        assert isinstance(managed, ProxyManagedServer)
        completion = await managed.chat_completion(messages=USER, max_tokens=3)
        assert completion.choices
        assert len((await managed.fetch_state())["nodes"]) == 1
        assert len(managed.get_state()["nodes"]) == 1
        managed.reset()
        assert (await managed.fetch_state())["nodes"] == []
        sid = managed.session_id
    assert httpx.get(f"{proxy.url}/{sid}/nodes", headers=AUTH).status_code == 404


def test_setup_needs_the_key_and_an_allowed_upstream(proxy, fake_pool):
    def setup(servers, headers=AUTH):
        return httpx.post(f"{proxy.url}/setup", json={"servers": servers}, headers=headers)

    vllm = {"server_type": "vllm", "timeout": 10}
    assert setup([{"base_url": fake_pool[2].base_url, **vllm}], headers={}).status_code == 401
    for url in ["http://evil.example/v1", "http://gpu-node.internal:9002/v1", "file:///etc"]:
        refused = setup([{"base_url": fake_pool[2].base_url, **vllm}, {"base_url": url, **vllm}])
        assert refused.status_code == 403, url
        assert refused.json()["error"]["param"] == "servers.1.base_url"
    allowed = setup([{"base_url": "http://gpu-node.internal:9001/v1", **vllm}])
    assert allowed.json()["status"] == "ok" and allowed.json()["servers"] == 1
    back = setup([{"base_url": fake_pool[2].base_url, **vllm}])
    assert back.status_code == 200
    sid = httpx.post(f"{proxy.url}/sessions/create", json={}, headers=AUTH).json()["uuid"]
    done = httpx.post(
        f"{proxy.url}/{sid}/v1/completions", json={"prompt": "abc", "max_tokens": 3}, headers=AUTH
    )
    assert done.status_code == 200 and done.json()["choices"]


def test_public_bind_without_a_key_warns_and_disables_setup(tmp_path, fake_pool, monkeypatch):
    monkeypatch.delenv("ATROPOS_API_KEY", raising=False)
    with running_proxy(tmp_path, None, "--host", "0.0.0.0") as proxy:
        url = proxy.url
        setup = httpx.post(
            f"{url}/setup",
            json={"servers": [{"base_url": fake_pool[2].base_url, "server_type": "vllm"}]},
        )
        assert setup.status_code == 403 and "API key" in setup.json()["error"]["message"]
        assert httpx.post(f"{url}/sessions/create", json={}).status_code == 409
        text_plain = httpx.post(
            f"{url}/sessions/create", content=b"{}", headers={"Content-Type": "text/plain"}
        )
        assert text_plain.status_code == 415
    assert "without an API key" in proxy.log.read_text()


def test_upstream_policy_allows_loopback_and_listed_hosts_only():
    policy = UpstreamPolicy(["gpu1", "gpu2:9001", "*.cluster.local"])
    assert policy.allows("http://127.0.0.1:9001/v1") and policy.allows("http://localhost/v1")
    assert policy.allows("http://[::1]:8000/v1")
    assert policy.allows("http://gpu1:9005/v1") and policy.allows("https://GPU1/v1")
    assert policy.allows("http://gpu2:9001/v1") and not policy.allows("http://gpu2:9002/v1")
    assert policy.allows("http://node7.cluster.local:9000/v1")
    assert not policy.allows("http://cluster.local.evil.example/v1")
    assert not policy.allows("http://10.0.0.5/v1") and not policy.allows("ftp://gpu1/x")
    assert not policy.allows("") and not policy.allows(None)
    assert UpstreamPolicy(["*"]).allows("http://anything.example/v1")


# ----------------------------------------------------------------- built the original's way


class _MinimalConfig:
    model_name = "test_model"


async def test_create_app_with_the_original_signature_over_a_manager_built_with_new(tokenizer):
    harness = ServerHarness()
    harness.tokenizer = tokenizer
    harness.config = _MinimalConfig()
    manager = ServerManager.__new__(ServerManager)
    manager.servers = [harness]
    app = create_app(manager, tokenizer, model_name="test_model")
    prompt = tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    outs = [tokenizer.encode(w, add_special_tokens=False) for w in ("red", "blue", "green")]
    harness.set_tokens_and_logprobs_response(
        prompt, output_tokens_list=outs, finish_reasons=["stop", "length", "stop"]
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        health = (await client.get("/health")).json()
        assert {k: health[k] for k in ("status", "model", "sessions", "servers")} == {
            "status": "ok",
            "model": "test_model",
            "sessions": 0,
            "servers": 1,
        }
        assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == ["test_model"]
        created = (await client.post("/sessions/create", json={})).json()
        sid = created["uuid"]
        assert created["model_name"] == "test_model"
        assert created["base_url"] == f"http://testserver/{sid}/v1"
        assert [s["uuid"] for s in (await client.get("/sessions")).json()["sessions"]] == [sid]
        chat = await client.post(
            f"/{sid}/v1/chat/completions", json={"messages": USER, "n": 3, "max_tokens": 4}
        )
        body = chat.json()
        assert chat.status_code == 200 and body["object"] == "chat.completion"
        assert [c["message"]["content"] for c in body["choices"]] == ["red", "blue", "green"]
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length", "stop"]
        nodes = (await client.get(f"/{sid}/nodes")).json()["nodes"]
        assert [n["masked_tokens"][-len(o) :] for n, o in zip(nodes, outs, strict=True)] == outs
        render = (
            await client.post(f"/{sid}/v1/chat/completions/render", json={"messages": USER})
        ).json()
        assert render["prompt_text"] == prompt
        assert (await client.delete(f"/{sid}")).json() == {"status": "deleted", "uuid": sid}
        missing = await client.delete(f"/{sid}")
        assert missing.status_code == 404
        assert set(missing.json()["error"]) == {"message", "type", "param", "code"}
        assert (await client.get("/health")).json()["sessions"] == 0


async def test_bodies_above_the_limit_get_413(tokenizer):
    manager = ServerManager.__new__(ServerManager)
    manager.servers = [ServerHarness()]
    app = create_app(manager, tokenizer, max_request_mb=0.001)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        sid = (await client.post("/sessions/create", json={})).json()["uuid"]
        big = [{"role": "user", "content": "x" * 4096}]
        r = await client.post(f"/{sid}/v1/chat/completions", json={"messages": big})
        assert r.status_code == 413 and r.json()["error"]["param"] == "body"

        async def chunks():
            for _ in range(8):
                yield b" " * 512

        streamed = await client.post(
            f"/{sid}/v1/chat/completions",
            content=chunks(),
            headers={"Content-Type": "application/json"},
        )
        assert streamed.status_code == 413
