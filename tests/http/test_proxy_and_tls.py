"""Every call goes through the environment's proxy and trust store, as the openai SDK's would:
``HTTPS_PROXY`` → ``CONNECT host:443`` for an ``https`` inference server, ``HTTP_PROXY`` →
absolute-form requests for plain ``http`` (inference and rollout API alike), ``NO_PROXY``
bypasses, ``SSL_CERT_FILE`` trusts a CA of our own, and an untrusted certificate fails
saying so. Real servers on loopback: a forward proxy, TLS and plain OpenAI stubs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from atroposlib.envs.api_client import RolloutAPIClient
from atroposlib.envs.server_handling._transport import JsonTransport
from atroposlib.envs.server_handling.errors import ServerConnectionError, ServerTLSError
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.server_handling.server_manager import ServerManager
from tests.http.forward_proxy import Authority, ForwardProxy, OpenAIStub

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No proxy or trust-store variables but those a test sets."""
    for name in list(os.environ):
        if name.lower() in ("http_proxy", "https_proxy", "all_proxy", "no_proxy") or name in (
            "SSL_CERT_FILE",
            "SSL_CERT_DIR",
        ):
            monkeypatch.delenv(name)


@pytest.fixture
def authority(tmp_path: Path) -> Authority:
    return Authority(tmp_path)


def _manager(base_url: str, **kw: object) -> ServerManager:
    settings = {"timeout": 10, **kw}
    config = APIServerConfig(base_url=base_url, model_name="fake", api_key="k", **settings)
    return ServerManager([config])


async def test_an_https_inference_server_is_reached_through_the_proxy_with_connect(
    authority: Authority, monkeypatch: pytest.MonkeyPatch
):
    """The host name is never resolved here (no resolver knows ``inference.test``): the
    proxy is asked to ``CONNECT`` to it, and the certificate is checked against the CA
    ``SSL_CERT_FILE`` names."""
    async with OpenAIStub(tls=authority.server_context("inference.test")) as stub:
        async with ForwardProxy({"inference.test:443": ("127.0.0.1", stub.port)}) as proxy:
            monkeypatch.setenv("HTTPS_PROXY", proxy.url)
            monkeypatch.setenv("SSL_CERT_FILE", authority.ca_file)
            manager = _manager("https://inference.test/v1")
            try:
                answer = await manager.chat_completion(messages=MESSAGES, max_tokens=4)
            finally:
                for server in manager.servers:
                    await server.close()
    assert answer.choices[0].message.content == "4"
    assert "CONNECT inference.test:443" in proxy.seen
    assert all(line == "CONNECT inference.test:443" for line in proxy.seen), proxy.seen
    assert "POST /v1/chat/completions HTTP/1.1" in stub.requests


async def test_http_proxy_carries_plain_inference_and_rollout_api_calls(
    monkeypatch: pytest.MonkeyPatch,
):
    async with OpenAIStub() as stub:
        routes = {
            "inference.test:80": ("127.0.0.1", stub.port),
            "api.test:80": ("127.0.0.1", stub.port),
        }
        async with ForwardProxy(routes) as proxy:
            monkeypatch.setenv("HTTP_PROXY", proxy.url)
            transport = JsonTransport(timeout=10)
            api = RolloutAPIClient("http://api.test", timeout=10)
            try:
                data = await transport.post_json("http://inference.test/v1/chat/completions", {})
                assert data["choices"][0]["message"]["content"] == "4"
                assert (await api.info())["object"] == "list"
            finally:
                await transport.close()
                await api.aclose()
    assert "POST http://inference.test/v1/chat/completions" in proxy.seen
    assert "GET http://api.test/info" in proxy.seen
    assert stub.requests == ["POST /v1/chat/completions HTTP/1.1", "GET /info HTTP/1.1"]


async def test_no_proxy_hosts_are_reached_directly(
    authority: Authority, monkeypatch: pytest.MonkeyPatch
):
    async with OpenAIStub(tls=authority.server_context("127.0.0.1")) as stub:
        async with ForwardProxy() as proxy:
            monkeypatch.setenv("HTTPS_PROXY", proxy.url)
            monkeypatch.setenv("HTTP_PROXY", proxy.url)
            monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
            monkeypatch.setenv("SSL_CERT_FILE", authority.ca_file)
            transport = JsonTransport(timeout=10)
            try:
                data = await transport.post_json(f"https://127.0.0.1:{stub.port}/v1/x", {})
            finally:
                await transport.close()
    assert data["choices"][0]["message"]["content"] == "4"
    assert proxy.seen == [] and len(stub.requests) == 1


async def test_an_untrusted_certificate_fails_naming_certificate_verification(
    authority: Authority,
):
    """Before: the health probe failed quietly and the call ended in "unavailable:
    TimeoutError". Now the error says what failed and what to set."""
    async with OpenAIStub(tls=authority.server_context("127.0.0.1")) as stub:
        transport = JsonTransport(timeout=10)
        try:
            with pytest.raises(ServerTLSError) as direct:
                await transport.post_json(f"https://127.0.0.1:{stub.port}/v1/x", {})
        finally:
            await transport.close()
        manager = _manager(f"https://127.0.0.1:{stub.port}/v1", timeout=2)
        try:
            with pytest.raises(Exception) as through_manager:
                await manager.chat_completion(messages=MESSAGES, max_tokens=4)
        finally:
            for server in manager.servers:
                await server.close()
    assert isinstance(direct.value, ServerConnectionError)
    assert "TLS certificate verification failed for 127.0.0.1" in str(direct.value)
    assert "SSL_CERT_FILE" in str(direct.value)
    assert "TLS certificate verification failed" in str(through_manager.value), repr(
        through_manager.value
    )
    assert stub.requests == []  # nothing was sent over an unverified connection


async def test_a_peer_checked_transport_connects_directly_and_only_where_allowed(
    monkeypatch: pytest.MonkeyPatch,
):
    """The proxy's upstreams named through ``/setup``: the check must see the address
    connected to, so no proxy stands between; a refused address is a connection error."""
    async with OpenAIStub() as stub:
        async with ForwardProxy() as proxy:
            monkeypatch.setenv("HTTP_PROXY", proxy.url)
            allowed = JsonTransport(timeout=10)
            allowed.peer_check = lambda host, address: address == "127.0.0.1"
            refused = JsonTransport(timeout=10)
            refused.peer_check = lambda host, address: False
            url = f"http://127.0.0.1:{stub.port}/v1/x"
            try:
                assert (await allowed.post_json(url, {}))["id"] == "chatcmpl-1"
                with pytest.raises(ServerConnectionError, match="not an allowed upstream"):
                    await refused.post_json(url, {})
            finally:
                await allowed.close()
                await refused.close()
    assert proxy.seen == [] and len(stub.requests) == 1
