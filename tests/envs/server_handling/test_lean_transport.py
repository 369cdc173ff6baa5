"""The inference client's one HTTP path: the JSON transport over aiohttp, the requests
OpenAIServer builds, and the lean fake server."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from atroposlib.envs.server_handling._transport import JsonTransport
from atroposlib.envs.server_handling.errors import is_transport_error
from atroposlib.envs.server_handling.openai_server import OpenAIRequest, OpenAIServer
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.testing.launch import fake_server_cmd
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import running_process


async def _serve_raw(handler) -> tuple[asyncio.AbstractServer, int]:
    """A one-off TCP server whose connection handler is ``handler(reader, writer)``."""
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + (await reader.readexactly(length) if length else b"")


async def test_json_transport_reuses_one_connection_and_reads_chunked_bodies():
    connections = 0

    async def handler(reader, writer):
        nonlocal connections
        connections += 1
        for _ in range(3):
            request = await _read_request(reader)
            assert b"Content-Length: 2" in request and request.endswith(b"{}")
            writer.write(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                b'3\r\n{"a\r\n5\r\n": 1}\r\n0\r\n\r\n'
            )
            await writer.drain()
        writer.close()

    server, port = await _serve_raw(handler)
    transport = JsonTransport(timeout=5)
    try:
        for _ in range(3):
            assert await transport.post_json(f"http://127.0.0.1:{port}/x", {}) == {"a": 1}
        assert connections == 1
    finally:
        await transport.close()
        server.close()


async def test_json_transport_survives_a_server_closing_idle_connections():
    seen = 0

    async def handler(reader, writer):
        nonlocal seen
        await _read_request(reader)
        seen += 1
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        writer.close()  # the server drops keep-alive connections after each answer

    server, port = await _serve_raw(handler)
    transport = JsonTransport(timeout=5)
    try:
        for _ in range(2):
            await asyncio.sleep(0.05)  # the close reaches the client before the next call
            assert await transport.post_json(f"http://127.0.0.1:{port}/", {}) == {}
        assert seen == 2
    finally:
        await transport.close()
        server.close()


async def test_json_transport_times_out_instead_of_hanging_and_refusal_is_a_transport_error():
    from atroposlib.envs.server_handling.errors import ServerConnectionError, ServerTimeoutError

    async def handler(reader, writer):
        await _read_request(reader)
        await asyncio.sleep(30)

    server, port = await _serve_raw(handler)
    transport = JsonTransport(timeout=0.3)
    try:
        with pytest.raises(ServerTimeoutError) as exc:
            await transport.post_json(f"http://127.0.0.1:{port}/", {})
        assert is_transport_error(exc.value) and isinstance(exc.value, asyncio.TimeoutError)
        with pytest.raises(ServerConnectionError, match="cannot reach") as refused:
            await transport.post_json(f"http://127.0.0.1:{free_port()}/", {}, timeout=2)
        assert is_transport_error(refused.value) and isinstance(refused.value, ConnectionError)
    finally:
        await transport.close()
        server.close()


async def test_json_transport_reports_a_connection_cut_mid_answer():
    from atroposlib.envs.server_handling.errors import ServerReadError

    async def handler(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()
        writer.close()

    server, port = await _serve_raw(handler)
    transport = JsonTransport(timeout=5)
    try:
        with pytest.raises(ServerReadError, match="broke before its answer was complete"):
            await transport.post_json(f"http://127.0.0.1:{port}/", {})
    finally:
        await transport.close()
        server.close()


async def test_json_transport_sends_the_key_and_raises_status_errors_with_the_body():
    seen_headers = []

    async def handler(reader, writer):
        request = await _read_request(reader)
        seen_headers.append(request)
        body = b'{"error":"bad n"}'
        writer.write(
            b"HTTP/1.1 422 Unprocessable\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        writer.close()

    server, port = await _serve_raw(handler)
    transport = JsonTransport({"Authorization": "Bearer k1"}, timeout=5)
    try:
        with pytest.raises(openai.UnprocessableEntityError) as exc:
            await transport.post_json(f"http://127.0.0.1:{port}/generate", {"n": 0})
        assert exc.value.status_code == 422 and "bad n" in exc.value.response.text
        assert exc.value.body == "bad n"  # as the openai client: the `error` member
        assert b"Authorization: Bearer k1" in seen_headers[0]
        assert b'"n":0' in seen_headers[0]
    finally:
        await transport.close()
        server.close()


def test_request_merges_extra_body_and_applies_client_options_to_the_http_request():
    request = OpenAIRequest(
        {
            "model": "m",
            "n": 2,
            "max_tokens": openai.NOT_GIVEN,
            "extra_body": {"top_k": 5},
            "extra_headers": {"X-Trace": "t1", "X-Dropped": None},
            "extra_query": {"api-version": "2"},
            "timeout": httpx.Timeout(3.0, read=7.0),
        }
    )
    assert request.body == {"model": "m", "n": 2, "top_k": 5}
    assert request.headers == {"X-Trace": "t1"}
    assert request.url("http://h/v1/chat/completions") == (
        "http://h/v1/chat/completions?api-version=2"
    )
    assert request.timeout == 7.0 and not request.stream
    assert OpenAIRequest({"model": "m", "stream": True}).stream
    assert OpenAIRequest({"timeout": httpx.Timeout(None)}).timeout is None
    with pytest.raises(TypeError, match="timeout"):
        OpenAIRequest({"timeout": "5"})
    with pytest.raises(TypeError, match="extra_body"):
        OpenAIRequest({"model": "m", "extra_body": [1]})


@pytest.mark.parametrize("mode", [[], ["--lean"]], ids=["uvicorn", "lean"])
def test_fake_server_modes_answer_alike_and_lean_path_builds_openai_objects(mode, tmp_path):
    port = free_port()
    cmd = fake_server_cmd(port, "--latency-ms", "1", *mode)
    with running_process(
        cmd, health_url=f"http://127.0.0.1:{port}/health", log_path=tmp_path / "f.log"
    ):
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=10) as c:
            comp = c.post(
                f"{url}/v1/completions", json={"prompt": "hi", "n": 2, "max_tokens": 4, "seed": 1}
            )
            assert [ch["text"] for ch in comp.json()["choices"]] == ["zr", "ljvl"]
            bad = c.post(f"{url}/v1/chat/completions", json={"messages": []})
            assert bad.status_code == 422 and "messages" in bad.json()["error"]["message"]
            assert c.post(f"{url}/generate", content=b"{oops").status_code == 400
            assert c.get(f"{url}/nope").status_code == 404

        async def through_server():
            server = OpenAIServer(
                APIServerConfig(
                    model_name="fake",
                    base_url=f"{url}/v1",
                    api_key="k",
                    timeout=10,
                    health_check=False,
                )
            )
            try:
                chat = await server.chat_completion(
                    messages=[{"role": "user", "content": "x"}], n=3, max_tokens=4
                )
                text = await server.completion(prompt="hi", n=2, max_tokens=4, seed=1)
                with pytest.raises(openai.UnprocessableEntityError, match="messages"):
                    await server.chat_completion(messages=[])
                return chat, text
            finally:
                await server.close()

        chat, text = asyncio.run(through_server())
        assert isinstance(chat, ChatCompletion) and [c.index for c in chat.choices] == [0, 1, 2]
        assert all(isinstance(c.message.content, str) for c in chat.choices)
        assert isinstance(text, Completion) and [c.text for c in text.choices] == ["zr", "ljvl"]


def _self_signed(tmp_path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 signed by its own key: ``(cert_file, key_file)``."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert_file), str(key_file)


async def test_https_goes_through_the_same_client_and_verifies_the_certificate(
    tmp_path, monkeypatch
):
    """``https`` goes over the same session; a certificate that does not verify says so."""
    import ssl

    from atroposlib.envs.server_handling.errors import ServerTLSError

    cert, key = _self_signed(tmp_path)
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)
    requests: list[bytes] = []

    async def handler(reader, writer):
        try:
            while True:
                request = await _read_request(reader)
                requests.append(request)
                writer.write(b'HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{"ok":true}')
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0, ssl=server_tls)
    url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}/generate"
    try:
        untrusted = JsonTransport(timeout=5)
        with pytest.raises(ServerTLSError, match="TLS certificate verification failed") as refused:
            await untrusted.post_json(url, {"n": 1})
        assert "SSL_CERT_FILE" in str(refused.value)
        assert isinstance(refused.value.__cause__.certificate_error, ssl.SSLCertVerificationError)
        assert is_transport_error(refused.value) and not requests
        await untrusted.close()

        monkeypatch.setenv("SSL_CERT_FILE", cert)  # the trust store the default context loads
        trusted = JsonTransport({"Authorization": "Bearer k"}, timeout=5)
        assert await trusted.post_json(url, {"n": 1}) == {"ok": True}
        assert await trusted.post_json(url, {"n": 2}) == {"ok": True}
        await trusted.close()
        assert len(requests) == 2 and b"Authorization: Bearer k" in requests[0]
        assert requests[1].endswith(b'{"n":2}')
    finally:
        server.close()
