"""Test helpers: a forward HTTP proxy, a certificate authority of our own, and a tiny
OpenAI-speaking server (plain or TLS) on loopback, all on the test's event loop."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHAT_ANSWER = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": "fake",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "4"},
            "finish_reason": "stop",
            "logprobs": None,
        }
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


@dataclass
class ForwardProxy:
    """A forward proxy on 127.0.0.1 that speaks ``CONNECT`` (tunnels for ``https``) and
    absolute-form requests (plain ``http``), recording each request line in ``seen``.

    ``routes`` maps a requested ``host:port`` to the address actually connected to, so a
    test can name hosts no resolver knows (``inference.test:443``): the client must leave
    them to the proxy.
    """

    routes: dict[str, tuple[str, int]] = field(default_factory=dict)
    seen: list[str] = field(default_factory=list)
    port: int = 0
    _server: asyncio.AbstractServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> ForwardProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()

    def _target(self, authority: str, default_port: int) -> tuple[str, int]:
        if ":" not in authority:
            authority = f"{authority}:{default_port}"
        if authority in self.routes:
            return self.routes[authority]
        host, _, port = authority.rpartition(":")
        return host, int(port)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        line, _, rest = head.partition(b"\r\n")
        method, target, version = line.decode("latin-1").split(" ", 2)
        self.seen.append(f"{method} {target}")
        if method == "CONNECT":
            up_reader, up_writer = await asyncio.open_connection(*self._target(target, 443))
            writer.write(b"HTTP/1.1 200 Connection Established\r\n\r\n")
            await writer.drain()
        else:
            scheme, _, after = target.partition("://")
            authority, slash, path = after.partition("/")
            up_reader, up_writer = await asyncio.open_connection(*self._target(authority, 80))
            origin = f"{method} /{path if slash else ''} {version}\r\n".encode("latin-1")
            up_writer.write(origin + rest)
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))


@dataclass
class Authority:
    """A certificate authority of its own in ``directory``: ``ca_file`` (PEM) to trust, and
    :meth:`server_context` for a server certificate it signed."""

    directory: Path
    ca_file: str = ""

    def __post_init__(self) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        self._x509, self._hashes, self._ser, self._ec = x509, hashes, serialization, ec
        self._key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "atroposlib test CA")])
        now = datetime.datetime.now(datetime.timezone.utc)
        self._name = name
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False
            )
            .sign(self._key, hashes.SHA256())
        )
        path = self.directory / "ca.pem"
        path.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))
        self.ca_file = str(path)

    def server_context(self, *names: str) -> ssl.SSLContext:
        """A server TLS context whose certificate (signed by this CA) names ``names``
        (host names or IP addresses)."""
        x509, ser = self._x509, self._ser
        key = self._ec.generate_private_key(self._ec.SECP256R1())
        alt: list[Any] = []
        for n in names:
            try:
                alt.append(x509.IPAddress(ipaddress.ip_address(n)))
            except ValueError:
                alt.append(x509.DNSName(n))
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, names[0])]))
            .issuer_name(self._name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                critical=False,
            )
            .sign(self._key, self._hashes.SHA256())
        )
        stem = self.directory / f"server-{len(list(self.directory.iterdir()))}"
        cert_file, key_file = stem.with_suffix(".crt"), stem.with_suffix(".key")
        cert_file.write_bytes(cert.public_bytes(ser.Encoding.PEM))
        key_file.write_bytes(
            key.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8, ser.NoEncryption())
        )
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(str(cert_file), str(key_file))
        return context


@dataclass
class OpenAIStub:
    """A loopback server (TLS with ``tls``) answering every POST with :data:`CHAT_ANSWER`
    and every GET with an empty model list; ``requests`` holds each request's first line."""

    tls: ssl.SSLContext | None = None
    requests: list[str] = field(default_factory=list)
    port: int = 0
    _server: asyncio.AbstractServer | None = None

    async def __aenter__(self) -> OpenAIStub:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                if length:
                    await reader.readexactly(length)
                first = head.split(b"\r\n", 1)[0].decode("latin-1")
                self.requests.append(first)
                answer = CHAT_ANSWER if first.startswith("POST") else {"object": "list", "data": []}
                body = json.dumps(answer).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()
