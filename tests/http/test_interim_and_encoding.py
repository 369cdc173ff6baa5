"""Our client stack against a raw socket server: 1xx interim answers are skipped (101 is
an error), and a compressed answer is inflated within the answer bound (a gzip bomb fails
fast, holding no more than the bound)."""

from __future__ import annotations

import asyncio
import gzip
import struct
import time
import tracemalloc
import zlib
from typing import AsyncIterator, Callable, List

import httpx
import pytest

from atroposlib.envs.api_client import RolloutAPIClient
from atroposlib.envs.server_handling._transport import JsonTransport
from atroposlib.http.client_session import AnswerTooLarge, MalformedAnswer, decode_content
from atroposlib.http.httpx_transport import AiohttpTransport

MANY_INTERIM_ANSWERS = 32

Script = Callable[[bytes], bytes]
"""What the server writes for one request (its head and body)."""


class RawServer:
    """``asyncio.start_server`` on 127.0.0.1: reads ``Content-Length`` requests and writes
    whatever ``script`` returns, verbatim; keeps every request it read."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: List[bytes] = []
        self.port = 0
        self._server: asyncio.AbstractServer | None = None

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
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
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                writer.write(self.script(request))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the client left, or the test's loop is closing
        finally:
            writer.close()


def final(body: bytes = b'{"ok": true}', *headers: str) -> bytes:
    extra = "".join(f"{h}\r\n" for h in headers)
    return (
        f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n{extra}"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
EARLY_HINTS = b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"


@pytest.fixture
async def raw() -> AsyncIterator[JsonTransport]:
    transport = JsonTransport(timeout=10)
    transport.max_answer_bytes = 1 << 20
    yield transport
    await transport.close()


async def _get(transport: JsonTransport, port: int, body: bytes = b"") -> tuple:
    return await transport.request("POST", f"http://127.0.0.1:{port}/x", body)


@pytest.mark.parametrize(
    "interims",
    [
        [CONTINUE],
        [EARLY_HINTS],
        [CONTINUE, EARLY_HINTS, CONTINUE, EARLY_HINTS],
        [CONTINUE] * MANY_INTERIM_ANSWERS,
    ],
)
async def test_interim_answers_are_skipped_and_the_final_one_is_the_answer(raw, interims):
    async with RawServer(lambda _: b"".join(interims) + final(b'{"n": 1}', "X-Final: yes")) as s:
        status, headers, body = await _get(raw, s.port, b"{}")
        assert (status, body) == (200, b'{"n": 1}')
        assert headers["x-final"] == "yes" and "link" not in headers
        # The connection stays in step: the next call on it gets its own answer.
        assert (await _get(raw, s.port))[0] == 200
        assert len(s.requests) == 2


async def test_an_interim_answer_split_across_reads_is_skipped_too(raw):
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        for piece in (
            b"HTTP/1.1 10",
            b"3 Early Hints\r\nLink: </a>\r\n",
            b"\r\nHTTP/1.1 100 ",
            b"Continue\r\n\r\n",
        ):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(final())
        await writer.drain()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        status, _, body = await _get(raw, server.sockets[0].getsockname()[1])
    finally:
        server.close()
    assert (status, body) == (200, b'{"ok": true}')


async def test_101_switching_protocols_is_a_protocol_error(raw):
    switch = (
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
    )
    async with RawServer(lambda _: switch + final()) as s:
        with pytest.raises(MalformedAnswer, match="101 Switching Protocols"):
            await _get(raw, s.port)


async def test_a_group_posted_through_a_100_continue_is_posted_once_and_acknowledged():
    """The original finding: the sender took 100 as the answer, counted the group
    undelivered and sent it again and again."""
    async with RawServer(lambda _: CONTINUE + EARLY_HINTS + final(b'{"status": "received"}')) as s:
        client = RolloutAPIClient(f"http://127.0.0.1:{s.port}")
        try:
            result = await client.post_scored({"tokens": [[1]], "masks": [[1]], "scores": [1.0]})
            status = await client.status_env(0)
        finally:
            await client.aclose()
    assert result.ok and result.status == 200
    assert status == {"status": "received"}
    assert len(s.requests) == 2


# ----------------------------------------------------------------- compressed answers


def _gzip_bomb(megabytes_out: int = 1024) -> bytes:
    """One gzip member, about 1 MB, that inflates to ``megabytes_out`` MiB of zeros: a MiB of
    zeros deflated once, the same block repeated (every block ends with a full flush, so
    each is independent and alike), and the member's trailer."""
    deflater = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    mib = bytes(1 << 20)
    first = deflater.compress(mib) + deflater.flush(zlib.Z_FULL_FLUSH)
    block = deflater.compress(mib) + deflater.flush(zlib.Z_FULL_FLUSH)
    assert block == deflater.compress(mib) + deflater.flush(zlib.Z_FULL_FLUSH)
    end = deflater.flush()
    # The CRC-32 of 1 GiB of zeros (zlib.crc32 over it; slow to compute, fixed).
    assert megabytes_out == 1024
    trailer = struct.pack("<II", 0x5B64C2B0, (megabytes_out << 20) & 0xFFFFFFFF)
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff"
    return header + first + block * (megabytes_out - 1) + end + trailer


@pytest.fixture(scope="module")
def bomb() -> bytes:
    return _gzip_bomb()


def test_the_bomb_is_a_megabyte_of_gzip_that_inflates_to_zeros(bomb):
    """Inflating all of it takes seconds (it was checked whole once: 1 GiB, CRC and length
    valid); here the first 8 MiB are checked, and the size."""
    assert 1_000_000 < len(bomb) < 1_100_000
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    start = inflater.decompress(bomb, 8 << 20)
    assert len(start) == 8 << 20 and start.count(0) == len(start)


def _encoded(body: bytes, coding: str) -> bytes:
    return (
        f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: {coding}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


@pytest.mark.parametrize(
    ("coding", "pack"),
    [
        ("gzip", gzip.compress),
        ("x-gzip", gzip.compress),
        ("deflate", zlib.compress),
        ("deflate", lambda b: zlib.compress(b)[2:-4]),  # raw deflate, as some servers send it
        ("identity", lambda b: b),
        ("gzip, identity", gzip.compress),
    ],
)
async def test_a_compressed_answer_is_decoded_through_httpx(coding, pack):
    payload = b'{"current_step": 3, "queue_size": 0, "pad": "' + b"x" * 5000 + b'"}'
    async with RawServer(lambda _: _encoded(pack(payload), coding)) as s:
        client = RolloutAPIClient(f"http://127.0.0.1:{s.port}")
        try:
            assert (await client.status_env(0))["current_step"] == 3
        finally:
            await client.aclose()
    lines = s.requests[0].split(b"\r\n")
    offered = [line.lower() for line in lines if line.lower().startswith(b"accept-encoding")]
    assert offered == [b"accept-encoding: gzip, deflate"]  # not br or zstd: not decoded here


async def test_a_gzip_bomb_fails_fast_naming_the_limit_with_bounded_memory(bomb):
    limit = 8 << 20
    async with RawServer(lambda _: _encoded(bomb, "gzip")) as s:
        client = httpx.AsyncClient(transport=AiohttpTransport(max_answer_bytes=limit))
        tracemalloc.start()
        started = time.perf_counter()
        try:
            with pytest.raises(httpx.RemoteProtocolError) as err:
                await client.get(f"http://127.0.0.1:{s.port}/status-env")
            took = time.perf_counter() - started
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            await client.aclose()
    assert "inflates past the limit of 8 MB (8388608 bytes)" in str(err.value)
    assert isinstance(err.value.__cause__, AnswerTooLarge)
    assert peak < 4 * limit, f"peak {peak / 2**20:.0f} MiB while decoding"  # 1 GiB unbounded
    assert took < 10, took  # a few ms of inflating; unbounded took seconds per GiB


async def test_the_rollout_api_client_refuses_a_gzip_bomb_status_answer(bomb):
    async with RawServer(lambda _: _encoded(bomb, "gzip")) as s:
        client = RolloutAPIClient(f"http://127.0.0.1:{s.port}")
        try:
            with pytest.raises(httpx.RemoteProtocolError, match="limit of 16 MB"):
                await client.status_env(0)
        finally:
            await client.aclose()


# mtime=0: the ids hold the bodies, and every pytest-xdist worker must collect the same ids
@pytest.mark.parametrize(
    ("headers", "body", "error", "match"),
    [
        ({"content-encoding": "br"}, b"x", MalformedAnswer, "unsupported Content-Encoding 'br'"),
        ({"content-encoding": "gzip"}, b"not gzip", MalformedAnswer, "gzip answer is not valid"),
        (
            {"content-encoding": "gzip"},
            gzip.compress(b"a" * 100, mtime=0)[:-9],
            MalformedAnswer,
            "truncated",
        ),
        (
            {"content-encoding": "gzip"},
            gzip.compress(b"a" * 101, mtime=0),
            AnswerTooLarge,
            "100 bytes",
        ),
        (
            {"content-encoding": "gzip"},
            gzip.compress(b"a" * 60, mtime=0) * 2,
            AnswerTooLarge,
            "limit",
        ),
        ({"content-encoding": "deflate"}, zlib.compress(b"a" * 101), AnswerTooLarge, "deflate"),
    ],
)
def test_decode_content_refuses_what_it_cannot_or_may_not_inflate(headers, body, error, match):
    with pytest.raises(error, match=match):
        decode_content(headers["content-encoding"], body, limit=100)


def test_decode_content_inflates_every_gzip_member_up_to_the_limit():
    assert decode_content("gzip", gzip.compress(b"ab") * 3, 6) == b"ab" * 3
    assert decode_content("gzip", gzip.compress(b"a" * 100), 100) == b"a" * 100
    assert decode_content("", b"plain", 1) == b"plain"  # nothing to inflate: the body bound holds
