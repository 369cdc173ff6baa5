"""The lean HTTP client against hostile answers: bounded headers and bodies, framing parsed
in one pass however the answer is split, redirects as errors, IPv6 literals, port 0, and a
peer check applied to the address actually connected to."""

from __future__ import annotations

import asyncio
import json
from typing import Iterator

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atroposlib.envs.server_handling._transport import JsonTransport
from atroposlib.http import client as _rawhttp
from atroposlib.http.client import (
    MAX_HEADER_BYTES,
    AnswerTooLarge,
    MalformedAnswer,
    PeerRefused,
    RawHttpClient,
    _Conn,
)
from tests.hostile_upstream import Upstream, running_upstream


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    with running_upstream() as up:
        yield up


def _feed(pieces: list[bytes], max_answer: int = 1 << 30) -> tuple[int, dict, bytes]:
    """Deliver ``pieces`` to a client connection as separate reads; its parsed answer."""

    async def run() -> tuple[int, dict, bytes]:
        conn = _Conn(max_answer)
        waiter = asyncio.get_running_loop().create_future()
        conn.waiter = waiter
        for piece in pieces:
            if waiter.done():
                break
            conn.data_received(piece)
        return await asyncio.wait_for(waiter, 1)

    return asyncio.run(run())


def _chunked(body: bytes, sizes: list[int], extension: bool, trailer: bool) -> bytes:
    out, pos, i = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"], 0, 0
    while pos < len(body):
        size = max(1, sizes[i % len(sizes)])
        piece = body[pos : pos + size]
        out.append(b"%x%s\r\n%s\r\n" % (len(piece), b";ext=1" if extension else b"", piece))
        pos, i = pos + size, i + 1
    out.append(b"0\r\nX-Trailer: yes\r\n\r\n" if trailer else b"0\r\n\r\n")
    return b"".join(out)


@settings(max_examples=150, deadline=None)
@given(
    body=st.binary(min_size=0, max_size=300),
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    cuts=st.lists(st.integers(0, 2000), max_size=30),
    extension=st.booleans(),
    trailer=st.booleans(),
)
def test_a_chunked_answer_split_anywhere_decodes_exactly(body, sizes, cuts, extension, trailer):
    """Reads can end anywhere: inside a size line, between CR and LF, inside the data."""
    wire = _chunked(body, sizes, extension, trailer)
    points = sorted({c % (len(wire) + 1) for c in cuts} | {0, len(wire)})
    pieces = [wire[a:b] for a, b in zip(points, points[1:], strict=False)]
    status, headers, got = _feed(pieces)
    assert status == 200 and got == body


def test_every_byte_is_handed_to_the_parser_once(monkeypatch):
    """Before: every read re-decoded the chunked body from its start (and re-searched the
    headers), so a long answer in small pieces cost time quadratic in its length."""
    fed = 0
    make = _rawhttp._new_parser

    class Counting:
        def __init__(self, conn):
            self.inner = make(conn)

        def feed_data(self, data):
            nonlocal fed
            fed += len(data)
            self.inner.feed_data(data)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    monkeypatch.setattr(_rawhttp, "_new_parser", Counting)
    body = bytes(range(256)) * 400  # 6,400 chunks of 16 bytes
    wire = _chunked(body, [16], extension=False, trailer=False)
    pieces = [wire[i : i + 1000] for i in range(0, len(wire), 1000)]
    status, _, got = _feed(pieces)
    assert got == body and fed == len(wire)


def test_an_answer_in_one_byte_chunks_is_refused_after_the_free_chunks():
    """Before: 3 MB of 1-byte chunks (18 MB of framing) was decoded at the cost of a call per
    byte; no server frames a JSON answer that way."""
    body = b"x" * (3 * _rawhttp.FREE_CHUNKS)
    wire = _chunked(body, [1], extension=False, trailer=False)
    pieces = [wire[i : i + 65536] for i in range(0, len(wire), 65536)]
    with pytest.raises(MalformedAnswer, match="chunks averaging under"):
        _feed(pieces)
    small = _chunked(b"x" * 100, [1], extension=False, trailer=False)  # a few are fine
    assert _feed([small])[2] == b"x" * 100


def test_headers_without_an_end_are_refused_at_the_header_bound():
    """Before: the client buffered header bytes until the server stopped sending (100 MB
    grew the buffer to 100 MB, searched from its start on every read)."""
    line = b"X-Pad: " + b"y" * 1000 + b"\r\n"
    pieces = [b"HTTP/1.1 200 OK\r\n"] + [line] * (4 * MAX_HEADER_BYTES // len(line))
    with pytest.raises(MalformedAnswer, match="headers exceed"):
        _feed(pieces)


def test_a_terminator_split_across_reads_is_found():
    wire = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    end = wire.index(b"\r\n\r\n")
    for cut in range(end, end + 4):
        assert _feed([wire[:cut], wire[cut:]]) == (200, {"content-length": "2"}, b"ok")


async def test_a_declared_length_above_the_bound_fails_before_the_body(upstream):
    """Content-Length 10**12 with 8 MB behind it: refused when the headers arrive."""
    upstream.mode(mode="huge_length", mb=8)
    client = RawHttpClient(max_answer_bytes=1024 * 1024)
    with pytest.raises(AnswerTooLarge, match="declares 1000000000000 bytes"):
        await client.request("POST", "127.0.0.1", upstream.port, "/generate", {}, b"{}", 30)
    client.close()


@pytest.mark.parametrize("mode", ["stream_close", "chunked"])
async def test_a_body_without_length_stops_at_the_bound(upstream, mode):
    upstream.mode(mode=mode, mb=8, pad=4 * 1024 * 1024, chunk=65536)
    client = RawHttpClient(max_answer_bytes=1024 * 1024)
    with pytest.raises(AnswerTooLarge, match="exceeds"):
        await client.request("POST", "127.0.0.1", upstream.port, "/generate", {}, b"{}", 30)
    client.close()


async def test_an_answer_within_the_bound_is_read_whole(upstream):
    upstream.mode(mode="chunked", pad=200_000, chunk=64)
    client = RawHttpClient(max_answer_bytes=1024 * 1024)
    status, _, body = await client.request(
        "POST", "127.0.0.1", upstream.port, "/generate", {}, b"{}", 30
    )
    client.close()
    assert status == 200 and json.loads(body)["padding"] == "p" * 200_000


async def test_a_redirect_is_an_error_not_an_empty_answer(upstream):
    """Before: a 302 was read as a 200 whose body was parsed as the answer."""
    upstream.mode(mode="raw", status=302, headers={"Location": "http://evil.example/"}, body="{}")
    transport = JsonTransport(timeout=10)
    with pytest.raises(openai.APIStatusError) as info:
        await transport.post_json(f"{upstream.url}/generate", {"a": 1})
    await transport.close()
    assert info.value.status_code == 302
    assert info.value.response.headers["location"] == "http://evil.example/"


def test_an_explicit_port_zero_is_kept():
    """Before: ``parts.port or 80`` sent a request for port 0 to port 80."""
    transport = JsonTransport()
    assert transport._target("http://127.0.0.1:0/generate") == ("127.0.0.1", 0, "/generate", False)
    assert transport._target("http://127.0.0.1/generate") == ("127.0.0.1", 80, "/generate", False)
    assert transport._target("http://[::1]:9/x?a=1") == ("::1", 9, "/x?a=1", False)
    assert transport._target("https://h.example/v1") == ("h.example", 443, "/v1", True)
    with pytest.raises(ValueError, match="expected http:// or https://"):
        transport._target("ftp://h.example/v1")


async def test_an_ipv6_literal_upstream_connects():
    """Before: the host was looked up as the name ``[::1]`` and the call failed."""
    with running_upstream("::1") as upstream:
        upstream.mode(mode="generate", token_ids=[5, 6])
        transport = JsonTransport(timeout=10)
        answer = await transport.post_json(f"http://[::1]:{upstream.port}/generate", {})
        await transport.close()
        assert answer["token_ids"] == [[5, 6]]


async def test_the_peer_check_sees_the_address_connected_to(upstream):
    """A name is resolved by the client and every address checked before connecting, so a
    name that resolves somewhere unexpected (DNS rebinding) reaches nothing."""
    before = sum(upstream.stats().values())
    seen: list[tuple[str, str]] = []

    def refuse(host: str, address: str) -> bool:
        seen.append((host, address))
        return False

    client = RawHttpClient(peer_check=refuse)
    with pytest.raises(PeerRefused, match="not an allowed upstream"):
        await client.request("POST", "localhost", upstream.port, "/generate", {}, b"{}", 10)
    assert seen and all(host == "localhost" for host, _ in seen)
    assert ("localhost", "127.0.0.1") in seen
    assert sum(upstream.stats().values()) == before  # nothing reached the server

    allowed = RawHttpClient(peer_check=lambda host, address: address == "127.0.0.1")
    upstream.mode(mode="generate", token_ids=[1])
    status, _, _ = await allowed.request(
        "POST", "localhost", upstream.port, "/generate", {}, b"{}", 10
    )
    allowed.close()
    assert status == 200
