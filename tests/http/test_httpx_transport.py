"""``AiohttpTransport``: httpx requests over our aiohttp session, against real loopback servers.

Most tests talk to :class:`_Upstream`, a raw HTTP/1.1 server on its own thread and event loop
(so it outlives each test's loop and sees the request bytes exactly as sent: duplicate
headers, the connection each request came on, how many requests it holds at once). The last
tests drive :class:`~atroposlib.envs.api_client.RolloutAPIClient` against a ``run-api`` process.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import socket
import threading
from typing import Any, Iterator
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from atroposlib.envs.api_client import PostResult, RolloutAPIClient
from atroposlib.http.httpx_transport import AiohttpTransport
from atroposlib.testing.launch import run_api_cmd
from atroposlib.testing.ports import free_port, start_on_free_port
from atroposlib.testing.processes import stop_process
from atroposlib.testing.trainer import register_trainer
from tests.api.conftest import group


class _Upstream:
    """A raw HTTP/1.1 server on a thread of its own, answering by path:

    ``/echo`` the request as JSON (keep-alive), ``/gzip`` a gzipped JSON answer, ``/missing``
    a 404, ``/slow`` nothing until the client goes away, ``/hold`` an answer once the test
    calls :meth:`release` (counting the requests held at once), ``/cut`` half an answer then a
    close, ``/malformed`` bytes that are not HTTP, ``/big?n=N`` and ``/bigchunked?n=N`` an
    ``N``-byte body (declared, or chunked).
    """

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.connections = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._gate = self._call(self._make_gate())
        self._server = self._call(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    async def _make_gate(self) -> asyncio.Semaphore:
        return asyncio.Semaphore(0)

    def reset(self) -> None:
        self.requests.clear()
        self.max_in_flight = 0

    def release(self, n: int) -> None:
        """Let ``n`` held ``/hold`` requests be answered."""
        for _ in range(n):
            self.loop.call_soon_threadsafe(self._gate.release)

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        self._call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn = self.connections
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")[:-2]
                method, target, _ = lines[0].split(" ", 2)
                headers = [tuple(part.strip() for part in line.split(":", 1)) for line in lines[1:]]
                length = sum(int(v) for k, v in headers if k.lower() == "content-length")
                body = await reader.readexactly(length) if length else b""
                request = {
                    "method": method,
                    "target": target,
                    "headers": headers,
                    "body": body,
                    "conn": conn,
                }
                self.requests.append(request)
                answer = await self._answer(request, reader)
                if answer is None:
                    return
                writer.write(answer)
                await writer.drain()
                if request.get("close"):
                    return
        finally:
            writer.close()

    async def _answer(self, request: dict[str, Any], reader: asyncio.StreamReader) -> bytes | None:
        parts = urlsplit(request["target"])
        query = parse_qs(parts.query)
        path = parts.path
        if path == "/echo":
            echo = {
                "method": request["method"],
                "target": request["target"],
                "body": request["body"].decode("latin-1"),
            }
            return _answer(200, json.dumps(echo).encode(), {"X-Answer": "yes"})
        if path == "/head":  # what a server answers to HEAD: the GET's headers, no body
            return b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Answer: head\r\n\r\n"
        if path == "/gzip":
            return _answer(200, gzip.compress(b'{"zipped": true}'), {"Content-Encoding": "gzip"})
        if path == "/missing":
            return _answer(404, b"no such thing")
        if path == "/slow":
            await reader.read()  # until the client gives up and closes
            return None
        if path == "/hold":
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await self._gate.acquire()
            finally:
                self.in_flight -= 1
            return _answer(200, b"held")
        if path in ("/cut", "/malformed"):
            request["close"] = True
        if path == "/cut":
            return b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b"
        if path == "/malformed":
            return b"THIS IS NOT HTTP\r\n\r\n"
        if path == "/big":
            return _answer(200, b"x" * int(query["n"][0]))
        if path == "/bigchunked":
            n = int(query["n"][0])
            chunks = b"".join(b"%x\r\n%s\r\n" % (100, b"y" * 100) for _ in range(n // 100))
            return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"
        return _answer(500, b"unknown path")


def _answer(status: int, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    head = [f"HTTP/1.1 {status} X", f"Content-Length: {len(body)}"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


@pytest.fixture(scope="module")
def upstream_server() -> Iterator[_Upstream]:
    server = _Upstream()
    yield server
    server.close()


@pytest.fixture
def upstream(upstream_server: _Upstream) -> _Upstream:
    upstream_server.reset()
    return upstream_server


@pytest.fixture(autouse=True)
def no_proxy_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests start from an environment without proxy variables (each sets the ones it needs)."""
    for name in list(os.environ):
        if name.lower() in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
            monkeypatch.delenv(name)


def _client(transport: AiohttpTransport | None = None, **timeouts: float) -> httpx.AsyncClient:
    timeout = httpx.Timeout(timeouts.pop("timeout", 10.0), **timeouts)
    return httpx.AsyncClient(transport=transport or AiohttpTransport(), timeout=timeout)


def _named(headers: list[tuple[str, ...]], name: str) -> list[str]:
    return [h[1] for h in headers if h[0].lower() == name]


async def _until(condition: Any, what: str) -> None:
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never happened: {what}")


# --------------------------------------------------------------------------- requests arrive


async def test_a_get_with_query_parameters_arrives_intact(upstream: _Upstream):
    params = {"env_id": 3, "q": "a b&c/é"}
    async with _client() as client:
        response = await client.get(f"{upstream.url}/echo", params=params)
    assert response.status_code == 200
    (seen,) = upstream.requests
    expected_target = httpx.URL(f"{upstream.url}/echo", params=params).raw_path.decode()
    assert (seen["method"], seen["target"], seen["body"]) == ("GET", expected_target, b"")
    assert parse_qs(urlsplit(seen["target"]).query) == {"env_id": ["3"], "q": ["a b&c/é"]}
    assert _named(seen["headers"], "host") == [f"127.0.0.1:{upstream.port}"]
    assert _named(seen["headers"], "content-length") in ([], ["0"])  # no body either way


async def test_a_post_with_a_gzipped_body_and_custom_headers_arrives_intact(upstream: _Upstream):
    body = gzip.compress(json.dumps({"tokens": list(range(500))}).encode())
    headers = {
        "Authorization": "Bearer s3cret",
        "Content-Type": "application/json",
        "Content-Encoding": "gzip",
        "X-Custom": "value with spaces",
    }
    async with _client() as client:
        response = await client.post(f"{upstream.url}/echo?x=1", content=body, headers=headers)
        # A caller's own Content-Length (the right one) is not sent twice either.
        await client.post(f"{upstream.url}/echo", content=b"abc", headers={"Content-Length": "3"})
    assert response.status_code == 200
    first, second = upstream.requests
    assert (first["method"], first["target"], first["body"]) == ("POST", "/echo?x=1", body)
    assert json.loads(gzip.decompress(first["body"])) == {"tokens": list(range(500))}
    for name, value in headers.items():
        assert _named(first["headers"], name.lower()) == [value]
    assert _named(first["headers"], "host") == [f"127.0.0.1:{upstream.port}"]
    assert _named(first["headers"], "content-length") == [str(len(body))]
    assert _named(first["headers"], "transfer-encoding") == []
    assert _named(second["headers"], "content-length") == ["3"] and second["body"] == b"abc"


async def test_a_streamed_request_body_is_sent_with_one_content_length(upstream: _Upstream):
    async def pieces():
        yield b"first,"
        yield b"second"

    async with _client() as client:
        await client.post(f"{upstream.url}/echo", content=pieces())
    (seen,) = upstream.requests
    assert seen["body"] == b"first,second"
    assert _named(seen["headers"], "content-length") == ["12"]
    assert _named(seen["headers"], "transfer-encoding") == []


# --------------------------------------------------------------------------- answers


async def test_an_answer_gives_its_status_headers_and_body(upstream: _Upstream):
    async with _client() as client:
        response = await client.post(f"{upstream.url}/echo", json={"a": 1})
    assert response.status_code == 200 and response.http_version == "HTTP/1.1"
    assert response.headers["x-answer"] == "yes"
    assert response.headers["content-length"] == str(len(response.content))
    assert response.json() == {"method": "POST", "target": "/echo", "body": '{"a":1}'}
    assert response.request.url == f"{upstream.url}/echo"


async def test_the_answer_to_head_ends_with_its_headers(upstream: _Upstream):
    async with _client(timeout=5) as client:
        response = await client.head(f"{upstream.url}/head")
        after = await client.get(f"{upstream.url}/echo")
    assert response.status_code == 200 and response.content == b""
    assert response.headers["content-length"] == "5" and response.headers["x-answer"] == "head"
    assert after.json()["method"] == "GET"  # the connection after a HEAD is not misread


async def test_a_gzip_encoded_answer_is_decoded_by_the_transport(upstream: _Upstream):
    """Decoded within the answer bound (httpx's decoders have none), so the headers describe
    the decoded body: no Content-Encoding, its own length."""
    async with _client() as client:
        response = await client.get(f"{upstream.url}/gzip")
    assert "content-encoding" not in response.headers
    assert int(response.headers["content-length"]) == len(response.content)
    assert response.json() == {"zipped": True}


async def test_raise_for_status_on_a_404_gives_an_http_status_error(upstream: _Upstream):
    async with _client() as client:
        response = await client.get(f"{upstream.url}/missing")
    assert response.status_code == 404 and response.text == "no such thing"
    with pytest.raises(httpx.HTTPStatusError) as caught:
        response.raise_for_status()
    assert caught.value.response.status_code == 404


async def test_sequential_requests_reuse_one_connection(upstream: _Upstream):
    async with _client() as client:
        for i in range(5):
            response = await client.get(f"{upstream.url}/echo", params={"i": i})
            assert response.status_code == 200
        await client.post(f"{upstream.url}/echo", content=b"x" * 5000)
    assert len(upstream.requests) == 6
    assert len({r["conn"] for r in upstream.requests}) == 1


# --------------------------------------------------------------------------- failures


def _expect(exc_type: type[httpx.HTTPError], caught: pytest.ExceptionInfo, url: str) -> None:
    """``caught`` is exactly the expected httpx error, with the request it failed on."""
    assert type(caught.value) is exc_type, repr(caught.value)
    assert isinstance(caught.value, httpx.HTTPError)
    assert caught.value.request.url == url


async def test_a_refused_connection_is_a_connect_error():
    url = f"http://127.0.0.1:{free_port()}/echo"
    async with _client() as client:
        with pytest.raises(httpx.ConnectError) as caught:
            await client.get(url)
    _expect(httpx.ConnectError, caught, url)
    assert "ConnectionRefusedError" in str(caught.value)


async def test_a_name_whose_every_address_refuses_is_a_connect_error(monkeypatch):
    """``localhost`` resolving to ``::1`` and ``127.0.0.1`` (as /etc/hosts has it on many
    systems), both refusing: asyncio reports one combined ``OSError``, still no connection."""
    port = free_port()
    loop = asyncio.get_running_loop()
    real_getaddrinfo = loop.getaddrinfo

    async def dual_stack(host, *args, **kwargs):
        if host != "localhost":
            return await real_getaddrinfo(host, *args, **kwargs)
        both = []
        for address in ("::1", "127.0.0.1"):
            both += await real_getaddrinfo(address, *args, **kwargs)
        return both

    monkeypatch.setattr(loop, "getaddrinfo", dual_stack)
    url = f"http://localhost:{port}/echo"
    async with _client() as client:
        with pytest.raises(httpx.HTTPError) as caught:
            await client.get(url)
    _expect(httpx.ConnectError, caught, url)


async def test_an_unknown_host_is_a_connect_error(monkeypatch):
    async def no_such_name(host, *args, **kwargs):  # what the resolver says, without asking one
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", no_such_name)
    url = "http://no-such-host.invalid/echo"
    async with _client() as client:
        with pytest.raises(httpx.HTTPError) as caught:
            await client.get(url)
    _expect(httpx.ConnectError, caught, url)
    assert "gaierror" in str(caught.value)


async def test_no_connection_within_the_connect_timeout_is_a_connect_timeout(monkeypatch):
    import aiohappyeyeballs

    async def never_connects(*args, **kwargs):
        await asyncio.Event().wait()

    monkeypatch.setattr(aiohappyeyeballs, "start_connection", never_connects)
    url = "http://127.0.0.1:9/echo"
    async with _client(timeout=30.0, connect=0.05) as client:
        with pytest.raises(httpx.HTTPError) as caught:
            await client.get(url)
    _expect(httpx.ConnectTimeout, caught, url)


async def test_an_answer_slower_than_the_read_timeout_is_a_read_timeout(upstream: _Upstream):
    url = f"{upstream.url}/slow"
    async with _client(timeout=0.1) as client:
        with pytest.raises(httpx.HTTPError) as caught:
            await client.get(url)
        # The timed-out connection is not reused: the next call answers normally.
        assert (await client.get(f"{upstream.url}/echo")).status_code == 200
    _expect(httpx.ReadTimeout, caught, url)
    assert upstream.requests[0]["conn"] != upstream.requests[1]["conn"]


async def test_the_server_closing_mid_answer_is_a_read_error(upstream: _Upstream):
    url = f"{upstream.url}/cut"
    async with _client() as client:
        with pytest.raises(httpx.HTTPError) as caught:
            await client.get(url)
    _expect(httpx.ReadError, caught, url)


async def test_a_malformed_answer_is_a_remote_protocol_error(upstream: _Upstream):
    url = f"{upstream.url}/malformed"
    async with _client() as client:
        with pytest.raises(httpx.HTTPError) as caught:
            await client.get(url)
    _expect(httpx.RemoteProtocolError, caught, url)


@pytest.mark.parametrize("path", ["big", "bigchunked"])
async def test_an_answer_above_max_answer_bytes_is_a_remote_protocol_error(
    upstream: _Upstream, path: str
):
    transport = AiohttpTransport(max_answer_bytes=1000)
    async with _client(transport) as client:
        assert len((await client.get(f"{upstream.url}/{path}?n=1000")).content) == 1000
        url = f"{upstream.url}/{path}?n=1100"
        with pytest.raises(httpx.HTTPError) as caught:
            await client.get(url)
    _expect(httpx.RemoteProtocolError, caught, url)
    assert "1000 bytes" in str(caught.value)


async def test_a_non_http_scheme_is_an_unsupported_protocol():
    request = httpx.Request("GET", "ftp://127.0.0.1/file")
    with pytest.raises(httpx.HTTPError) as caught:
        await AiohttpTransport().handle_async_request(request)
    assert type(caught.value) is httpx.UnsupportedProtocol
    assert caught.value.request is request


@pytest.mark.parametrize(
    "headers",
    [
        {"X-Note": "v\r\nX-Injected: 1"},
        {"X-Note": "v\nX-Injected: 1"},
        {"X-Note": "v\x00"},
        {"X-Bad Name": "v"},
        {"X-Bad\r\nX-Injected": "v"},
    ],
)
async def test_a_header_that_would_split_the_request_is_refused_unsent(
    upstream: _Upstream, headers: dict[str, str]
):
    """As httpx's own transport (h11) does: a CR, LF or NUL in a header value, or a name that
    is not a token, would let a caller's data write headers (or a request) of its own."""
    url = f"{upstream.url}/echo"
    async with _client() as client:
        with pytest.raises(httpx.HTTPError) as caught:
            await client.get(url, headers=headers)
    _expect(httpx.LocalProtocolError, caught, url)
    assert upstream.requests == []


# --------------------------------------------------------------------------- in-flight bound


async def test_at_most_max_connections_requests_are_at_the_server_at_once(upstream: _Upstream):
    async with _client(AiohttpTransport(max_connections=2)) as client:
        calls = [asyncio.create_task(client.get(f"{upstream.url}/hold")) for _ in range(6)]
        for _ in range(3):
            await _until(lambda: upstream.in_flight == 2, "two requests held")
            await asyncio.sleep(0.05)  # room for a third to arrive, were it let through
            assert upstream.in_flight == 2
            upstream.release(2)
        answers = await asyncio.gather(*calls)
    assert [a.text for a in answers] == ["held"] * 6
    assert upstream.max_in_flight == 2


async def test_a_failed_request_gives_its_slot_back(upstream: _Upstream):
    async with _client(AiohttpTransport(max_connections=1), pool=1.0) as client:
        for _ in range(3):
            with pytest.raises(httpx.ReadError):
                await client.get(f"{upstream.url}/cut")
        assert (await client.get(f"{upstream.url}/echo")).status_code == 200


@pytest.mark.parametrize("bad", [0, -1])
def test_max_connections_below_one_is_refused(bad: int):
    with pytest.raises(ValueError, match="max_connections"):
        AiohttpTransport(max_connections=bad)


# --------------------------------------------------------------------------- event loops


def test_one_transport_serves_one_event_loop_after_another(upstream: _Upstream):
    transport = AiohttpTransport()
    client = httpx.AsyncClient(transport=transport, timeout=10.0)

    async def call(i: int) -> int:
        response = await client.get(f"{upstream.url}/echo", params={"loop": i})
        return response.json()["target"]

    assert asyncio.run(call(1)) == "/echo?loop=1"
    assert asyncio.run(call(2)) == "/echo?loop=2"
    asyncio.run(client.aclose())
    # Each loop had a connection of its own (one loop's connections are unusable in another).
    assert len({r["conn"] for r in upstream.requests}) == 2


# --------------------------------------------------------------------------- proxies


async def test_rollout_client_uses_the_aiohttp_transport_with_or_without_proxies(monkeypatch):
    """Proxies are the session's business (``trust_env``): the transport is the same, and a
    transport given to the client is used as it is."""
    given = httpx.MockTransport(lambda request: httpx.Response(200))
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.example:3128")
    clients = [
        RolloutAPIClient("http://api.internal:8000"),
        RolloutAPIClient("https://127.0.0.1:8000"),
        RolloutAPIClient("http://api.internal:8000", transport=given),
    ]
    try:
        for client in clients[:2]:
            assert type(client._client._transport) is AiohttpTransport
            url = httpx.URL(f"{client.base_url}/status-env")
            assert client._client._transport_for_url(url) is client._client._transport
        assert clients[2]._client._transport is given
    finally:
        for client in clients:
            await client.aclose()


# --------------------------------------------------------------------------- run-api end to end

BATCH_SIZE = 8


@pytest.fixture(scope="module")
def run_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("api") / "api.log"
    proc, port = start_on_free_port(
        lambda port: run_api_cmd(port, "--log-level", "warning"), log_path=log
    )
    try:
        url = f"http://127.0.0.1:{port}"
        register_trainer(url, BATCH_SIZE, max_token_len=4096)
        yield url
    finally:
        stop_process(proc)


async def test_rollout_client_talks_to_run_api_over_the_aiohttp_transport(run_api: str):
    client = RolloutAPIClient(run_api, timeout=10.0)
    assert type(client._client._transport) is AiohttpTransport
    try:
        registered = await client.register_env(
            {
                "max_token_length": 4096,
                "desired_name": "aiohttp_transport_env",
                "weight": 1.0,
                "group_size": 4,
                "min_batch_allocation": None,
            }
        )
        assert registered["status"] == "success"
        env_id = registered["env_id"]
        assert await client.info() == {"batch_size": BATCH_SIZE, "max_token_len": 4096}
        before = await client.status_env(env_id)
        assert before["queue_size"] == 0

        big = group(4, seq_len=200, env_id=env_id, base=1)  # > 1 KiB of JSON: sent gzipped
        assert len(json.dumps(big)) > 1024
        assert await client.post_scored(big) == PostResult(status=200)
        many = [group(4, env_id=env_id, base=2), group(4, env_id=env_id, base=3)]
        assert await client.post_scored(many) == PostResult(status=200)

        after = await client.status_env(env_id)
        assert after["queue_size"] > before["queue_size"]
    finally:
        await client.aclose()
    batch = httpx.get(f"{run_api}/batch", timeout=10).json()["batch"]
    tokens = [seq for g in batch for seq in g["tokens"]]
    assert tokens[:8] == big["tokens"] + many[0]["tokens"]


async def test_post_scored_to_a_dead_port_reports_status_zero():
    client = RolloutAPIClient(f"http://127.0.0.1:{free_port()}", timeout=5.0)
    try:
        result = await client.post_scored(group(4))
    finally:
        await client.aclose()
    assert result.status == 0 and not result.ok and not result.rejected
    assert result.detail.startswith("ConnectError: ") and "ConnectionRefusedError" in result.detail
