"""The keep-alive client bounds the answer's header block itself, wherever it ends: a raw
socket server writes status line, headers and body in one write, so the headers are complete
within the read that carries them."""

from __future__ import annotations

import asyncio

import pytest

from atroposlib.http.client import MAX_HEADER_BYTES, MalformedAnswer, RawHttpClient


def _answer(status_line: str, headers: list[str], body: bytes = b'{"ok": true}') -> bytes:
    head = "".join(f"{h}\r\n" for h in headers)
    return f"{status_line}\r\n{head}Content-Length: {len(body)}\r\n\r\n".encode("latin-1") + body


async def _ask(answer: bytes) -> tuple:
    """Serve ``answer`` in one write to one request of the client; the client's result."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        await reader.read()  # until the client closes

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = RawHttpClient(max_answer_bytes=1 << 20)
    try:
        return await client.request("GET", "127.0.0.1", port, "/x", {}, b"", timeout=10)
    finally:
        client.close()
        server.close()


OVER = MAX_HEADER_BYTES + 6 * 1024  # past the bound, less than two loopback segments


@pytest.mark.parametrize(
    "answer",
    [
        _answer("HTTP/1.1 200 OK", [f"X-Pad-{i}: {'a' * 1000}" for i in range(OVER // 1000)]),
        _answer("HTTP/1.1 200 OK", [f"X-Big: {'b' * OVER}"]),
        _answer(f"HTTP/1.1 200 {'O' * OVER}", []),
    ],
    ids=["many headers", "one long header", "long reason phrase"],
)
async def test_headers_past_the_bound_are_refused_when_one_write_carries_them_and_the_body(
    answer,
):
    with pytest.raises(MalformedAnswer, match=f"headers exceed {MAX_HEADER_BYTES} bytes"):
        await _ask(answer)


async def test_headers_within_the_bound_arrive_with_the_body_in_one_write():
    pad = [f"X-Pad-{i}: {'a' * 1000}" for i in range(MAX_HEADER_BYTES // 1100)]
    status, headers, body = await _ask(_answer("HTTP/1.1 200 OK", pad))
    assert (status, body) == (200, b'{"ok": true}') and headers["x-pad-0"] == "a" * 1000
