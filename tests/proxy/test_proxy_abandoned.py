"""The managed-server proxy keeps only the nodes of answers it delivered, as processes: a
proxy over a fake inference server whose latency the test sets.

A client that times out and retries (the ``openai`` SDK with a short timeout) leaves no
node for the attempts it gave up on, plain or streamed; requests whose client left are
cancelled, so their slots on the proxy's server are free at once, ``atropos-serve-model``
stops their generations, and the next request is served promptly."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from atroposlib.testing.launch import serve_model_cmd
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import running_process
from atroposlib.testing.proxy import running_proxy
from tests.fake_servers import FakeServer, fake_servers

KEY = "abandon-proxy-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
USER = [{"role": "user", "content": "Name three colors."}]
SLOTS = 8


class Proxy:
    """The proxy process and its fake upstream."""

    def __init__(self, url: str, fake: FakeServer):
        self.url, self.fake = url, fake

    def session(self) -> str:
        r = httpx.post(f"{self.url}/sessions/create", json={}, headers=AUTH, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()["uuid"]

    def nodes(self, sid: str) -> list[dict]:
        return httpx.get(f"{self.url}/{sid}/nodes", headers=AUTH, timeout=10).json()["nodes"]

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def free_slots(self) -> int:
        r = httpx.get(f"{self.url}/servers", headers=AUTH, timeout=10)
        return int(r.json()["servers"][0]["free_slots"])

    def upstream_idle(self) -> None:
        """Wait until the fake upstream has finished every request it was sent."""
        for _ in range(200):
            if self.fake.stats()["in_flight"] == 0:
                return
            time.sleep(0.05)
        raise AssertionError(f"upstream still busy: {self.fake.stats()}")


@pytest.fixture(scope="module")
def proxy(tokenizer, tmp_path_factory) -> Iterator[Proxy]:
    tmp: Path = tmp_path_factory.mktemp("abandon-proxy")
    with fake_servers(1, "--latency-ms", "1") as (fake,):
        servers = [
            {
                "base_url": fake.base_url,
                "server_type": "vllm",
                "timeout": 30,
                "num_max_requests_at_once": SLOTS,
            }
        ]
        with running_proxy(tmp, servers, tokenizer=tokenizer, model_name="fake", api_key=KEY) as p:
            yield Proxy(p.url, fake)


@pytest.fixture
def slow(proxy: Proxy) -> Iterator[Proxy]:
    """The upstream answers after 1.5 s while the test runs."""
    proxy.fake.configure(latency_ms=1500)
    try:
        yield proxy
    finally:
        proxy.fake.configure(latency_ms=1)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_client_that_times_out_and_retries_leaves_only_its_delivered_node(slow, stream):
    proxy = slow
    sid = proxy.session()
    before = proxy.health().get("requests_abandoned", 0)
    client = openai.OpenAI(
        base_url=f"{proxy.url}/{sid}/v1", api_key=KEY, timeout=0.4, max_retries=2
    )
    with pytest.raises(openai.APITimeoutError):
        out = client.chat.completions.create(
            model="fake", messages=USER, max_tokens=8, stream=stream
        )
        if stream:
            list(out)
    # Every abandoned attempt's generation had time to end (upstream idle): none of
    # them left a node.
    proxy.upstream_idle()
    assert [n["full_text"] for n in proxy.nodes(sid)] == []
    abandoned = proxy.health().get("requests_abandoned", 0) - before
    assert abandoned == 3, abandoned  # the first try and two retries
    proxy.fake.configure(latency_ms=1)
    answer = openai.OpenAI(base_url=f"{proxy.url}/{sid}/v1", api_key=KEY, timeout=20)
    if stream:
        chunks = list(
            answer.chat.completions.create(model="fake", messages=USER, max_tokens=8, stream=True)
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        reply = answer.chat.completions.create(model="fake", messages=USER, max_tokens=8)
        text = reply.choices[0].message.content or ""
    nodes = proxy.nodes(sid)
    assert len(nodes) == 1, [n["full_text"] for n in nodes]
    assert text and text in nodes[0]["full_text"]


def test_abandoned_streams_free_their_slots_at_once(slow):
    proxy = slow
    sid = proxy.session()
    body = {"model": "fake", "messages": USER, "max_tokens": 8, "stream": True}

    async def abandon() -> None:
        async with httpx.AsyncClient(headers=AUTH, timeout=0.3) as client:

            async def one() -> None:
                with pytest.raises(httpx.TimeoutException):
                    async with client.stream(
                        "POST", f"{proxy.url}/{sid}/v1/chat/completions", json=body
                    ) as r:
                        async for _ in r.aiter_bytes():
                            pass

            await asyncio.gather(*(one() for _ in range(SLOTS)))

    asyncio.run(abandon())
    proxy.fake.configure(latency_ms=1)
    start = time.perf_counter()
    r = httpx.post(
        f"{proxy.url}/{sid}/v1/chat/completions",
        json={**body, "stream": False},
        headers=AUTH,
        timeout=20,
    )
    served_s = time.perf_counter() - start
    assert r.status_code == 200, r.text
    # The abandoned requests' slots were free at once: the next one did not wait for
    # their generations (1.5 s) to end.
    assert served_s < 0.8, served_s
    assert proxy.free_slots() == SLOTS
    proxy.upstream_idle()
    assert len(proxy.nodes(sid)) == 1


@pytest.fixture(scope="module")
def served(tokenizer, tiny_model_dir, tmp_path_factory) -> Iterator[str]:
    """A proxy over ``atropos-serve-model`` (the tiny model, 8 sequences at once)."""
    tmp: Path = tmp_path_factory.mktemp("abandon-serve")
    port = free_port()
    cmd = serve_model_cmd(tiny_model_dir, port, "--seed", "0", "--max-num-seqs", str(SLOTS))
    with running_process(
        cmd, health_url=f"http://127.0.0.1:{port}/health", timeout=180, log_path=tmp / "serve.log"
    ):
        servers = [
            {"base_url": f"http://127.0.0.1:{port}/v1", "server_type": "vllm", "timeout": 60}
        ]
        with running_proxy(tmp, servers, tokenizer=tokenizer, model_name="tiny", api_key=KEY) as p:
            yield p.url


def test_abandoned_streams_free_the_inference_servers_sequences(served):
    """Eight streams of long generations, abandoned: the proxy drops their upstream
    requests, the inference server stops them, and a short request is served at once
    instead of waiting behind generations nobody reads."""
    sid = httpx.post(f"{served}/sessions/create", json={}, headers=AUTH, timeout=10).json()["uuid"]
    url = f"{served}/{sid}/v1/chat/completions"
    long = {"messages": USER, "max_tokens": 3000, "stream": True, "ignore_eos": True}

    async def abandon() -> None:
        async with httpx.AsyncClient(headers=AUTH, timeout=0.5) as client:

            async def one() -> None:
                with pytest.raises(httpx.TimeoutException):
                    async with client.stream("POST", url, json=long) as r:
                        async for _ in r.aiter_bytes():
                            pass

            await asyncio.gather(*(one() for _ in range(SLOTS)))

    asyncio.run(abandon())
    start = time.perf_counter()
    r = httpx.post(url, json={"messages": USER, "max_tokens": 4}, headers=AUTH, timeout=120)
    served_s = time.perf_counter() - start
    assert r.status_code == 200, r.text
    assert served_s < 3.0, served_s
    nodes = httpx.get(f"{served}/{sid}/nodes", headers=AUTH, timeout=10).json()["nodes"]
    assert len(nodes) == 1
