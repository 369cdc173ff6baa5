"""Attacks on a real managed-server proxy process: values no upstream client can send on are a
400 naming the field (not a nameless ``TypeError``), ``/setup`` refuses every disguise of a
foreign upstream, a browser on another site cannot post even without ``Origin``, and a
tokenizer that cannot be loaded is a 409 that does not stall other requests."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from atroposlib.envs.server_handling.managed_server_proxy import create_app
from atroposlib.envs.server_handling.server_harness import ServerHarness
from atroposlib.envs.server_handling.server_manager import ServerManager
from atroposlib.testing.proxy import running_proxy
from tests.fake_servers import fake_servers

KEY = "redteam-proxy-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def proxy(tokenizer, tmp_path_factory):
    """The proxy, keyed, over one fake vLLM-style server of its own (started alongside)."""
    with (
        fake_servers(1, "--latency-ms", "1") as (fake,),
        running_proxy(
            tmp_path_factory.mktemp("redteam-proxy"),
            [{"base_url": fake.base_url, "server_type": "vllm"}],
            tokenizer=tokenizer,
            model_name="fake",
            api_key=KEY,
        ) as proxy,
    ):
        yield proxy.url


def _raw(url: str, body: dict, surrogate: bool = False) -> httpx.Response:
    text = json.dumps(body)
    if surrogate:
        text = text.replace("SURROGATE", "\\ud800")
    return httpx.post(
        url, content=text.encode(), headers={**AUTH, "Content-Type": "application/json"}
    )


@pytest.mark.parametrize(
    ("extra", "param", "surrogate"),
    [
        ({"top_k": 10**30}, "top_k", False),
        ({"logit_bias": {"1": 2**70}}, "logit_bias.1", False),
        ({"presence_penalty": -(2**64)}, "presence_penalty", False),
        ({"stop": "SURROGATE"}, "stop", True),
        ({"messages": [{"role": "user", "content": "SURROGATE"}]}, "messages.0.content", True),
        ({"metadata": {"a": [1, "xSURROGATE"]}}, "metadata.a.1", True),
    ],
)
def test_values_no_client_can_forward_are_400_naming_the_field(proxy, extra, param, surrogate):
    """Before: 400 with ``param: null`` and "TypeError: Integer exceeds 64-bit range"."""
    sid = httpx.post(f"{proxy}/sessions/create", json={}, headers=AUTH).json()["uuid"]
    for path in ("/v1/chat/completions", "/v1/chat/completions/render"):
        r = _raw(f"{proxy}/{sid}{path}", {"messages": USER, "max_tokens": 1, **extra}, surrogate)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text
    r = _raw(f"{proxy}/{sid}/v1/completions", {"prompt": "hi", "max_tokens": 1, **extra}, surrogate)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_bad_sampling_values_are_400_naming_the_field(proxy):
    sid = httpx.post(f"{proxy}/sessions/create", json={}, headers=AUTH).json()["uuid"]
    failures = []
    with httpx.Client(headers={**AUTH, "Content-Type": "application/json"}) as client:
        for field in ("n", "max_tokens", "temperature", "top_p", "seed"):
            for literal in ("NaN", "Infinity", "1e400", str(2**64), '"x"', '{"a": 1}', "[[1]]"):
                text = json.dumps({"messages": USER, field: "V"}).replace('"V"', literal)
                r = client.post(f"{proxy}/{sid}/v1/chat/completions", content=text.encode())
                if r.status_code != 400 or r.json()["error"]["param"] != field:
                    failures.append((field, literal, r.status_code))
    assert not failures, failures


@pytest.mark.parametrize(
    "upstream",
    [
        "http://127.0.0.1@evil.example/v1",
        "http://evil.example#@127.0.0.1/v1",
        "http://localhost.evil.example/v1",
        "http://127.0.0.1.evil.example/v1",
        "http://[::ffff:7f00:1]/v1",
        "http://0.0.0.0:9000/v1",
        "file:///etc/passwd",
        "gopher://127.0.0.1:25/",
        "http://gpu-node.internal:9001/v1",
    ],
)
def test_setup_refuses_disguised_foreign_upstreams(proxy, upstream):
    r = httpx.post(
        f"{proxy}/setup",
        json={"servers": [{"base_url": upstream, "server_type": "vllm"}]},
        headers=AUTH,
    )
    assert r.status_code == 403, r.text
    assert r.json()["error"]["param"] == "servers.0.base_url"


def test_cross_site_posts_without_origin_are_refused(proxy):
    cross = {**AUTH, "Sec-Fetch-Site": "cross-site"}
    assert httpx.post(f"{proxy}/sessions/create", json={}, headers=cross).status_code == 403
    sid = httpx.post(f"{proxy}/sessions/create", json={}, headers=AUTH).json()["uuid"]
    assert httpx.delete(f"{proxy}/{sid}", headers=cross).status_code == 403
    assert httpx.post(f"{proxy}/{sid}/reset", headers=cross).status_code == 403
    assert httpx.delete(f"{proxy}/{sid}", headers=AUTH).status_code == 200


async def test_an_unloadable_tokenizer_is_409_and_does_not_stall_the_proxy(monkeypatch):
    """A config naming a tokenizer that cannot load was a 500, loaded on the event loop (a
    minute of hub retries during which /health did not answer)."""
    import atroposlib.proxy.state as proxy_module

    loading, loaded = threading.Event(), threading.Event()
    release = threading.Event()

    def slow_missing(name):
        loading.set()
        release.wait(30)  # held until /health has answered (30 s: a hang guard only)
        loaded.set()
        return None

    monkeypatch.setattr(proxy_module, "load_tokenizer", slow_missing)
    manager = ServerManager.__new__(ServerManager)
    manager.servers = [ServerHarness()]
    app = create_app(manager, None)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        create = asyncio.create_task(client.post("/sessions/create", json={}))
        assert await asyncio.to_thread(loading.wait, 30)  # the load has begun
        assert (await client.get("/health")).status_code == 200
        assert not loaded.is_set()  # /health answered while the tokenizer was still loading
        release.set()
        r = await create
        assert r.status_code == 409 and r.json()["error"]["param"] == "tokenizer"


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 5000 + b"]" * 5000,
        b'{"a":' * 5000 + b"1" + b"}" * 5000,
        b'{"messages": [], "max_tokens": ' + b"9" * 5000 + b"}",
        b'{"messages": "\xff"}',
    ],
    ids=["deep array", "deep object", "5000-digit number", "invalid utf-8"],
)
def test_unparseable_bodies_are_400_not_500(proxy, body):
    """Deep nesting (RecursionError) and huge numbers (int conversion limit) were 500s."""
    sid = httpx.post(f"{proxy}/sessions/create", json={}, headers=AUTH).json()["uuid"]
    for path in (f"/{sid}/v1/chat/completions", f"/{sid}/v1/completions", "/sessions/create"):
        r = httpx.post(
            f"{proxy}{path}", content=body, headers={**AUTH, "Content-Type": "application/json"}
        )
        assert r.status_code == 400, (path, r.status_code, r.text[:200])
        assert "not valid JSON" in r.json()["error"]["message"]
