"""The keep-alive client's error taxonomy (``atroposlib.http.client``): each kind of failure
produced against a raw socket server on loopback, the builtin errors each still is, and the
two tables that map them (``httpx_transport.HTTPX_ERRORS``, ``errors.CLIENT_ERRORS``)."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import openai
import pytest

from atroposlib.envs.server_handling._transport import JsonTransport
from atroposlib.envs.server_handling.errors import (
    CLIENT_ERRORS,
    ServerConnectionError,
    ServerReadError,
    ServerTimeoutError,
    mapped_errors,
)
from atroposlib.http import client as raw
from atroposlib.http.client import (
    AnswerTooLarge,
    ConnectError,
    ConnectTimeout,
    LoopClient,
    MalformedAnswer,
    ProtocolError,
    RawHttpClient,
    ReadError,
    ReadTimeout,
    StaleConnection,
    TransportError,
    error_for,
)
from atroposlib.http.httpx_transport import HTTPX_ERRORS, RawHttpTransport
from atroposlib.testing.ports import free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[int]:
    """A socket server on 127.0.0.1 that answers every connection with ``handler``; its port."""
    writers: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await reader.readuntil(b"\r\n\r\n")  # the request's head (these requests have no body)
        await handler(reader, writer)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        for writer in writers:
            writer.transport.abort()
        server.close()
        await server.wait_closed()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0), not a FIN."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _reset_mid_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"x" * 100)
    await writer.drain()
    _reset(writer)


async def _never_answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await asyncio.Event().wait()


async def _oversized(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10000000000\r\n\r\n")
    await writer.drain()


async def _malformed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 two hundred\r\n\r\n")
    await writer.drain()


async def _closes_silently(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.close()


async def _get(port: int, timeout: float = 5.0, **kwargs) -> tuple[int, dict, bytes]:
    client = RawHttpClient(max_answer_bytes=1 << 20)
    try:
        return await client.request("GET", "127.0.0.1", port, "/", {}, b"", timeout, **kwargs)
    finally:
        client.close()


async def test_a_refused_connection_is_a_connect_error_and_still_an_os_error():
    with pytest.raises(ConnectError) as caught:
        await _get(free_port())
    assert isinstance(caught.value, ConnectionError) and isinstance(caught.value, OSError)
    assert isinstance(caught.value.__cause__, ConnectionRefusedError)
    assert "ConnectionRefusedError" in str(caught.value)


async def test_no_connection_in_time_is_a_connect_timeout_and_still_an_asyncio_timeout():
    # A listening socket whose accept queue is full drops further connection attempts.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
            fillers.append(filler)
        with pytest.raises(ConnectTimeout) as caught:
            await _get(port, connect_timeout=0.2)
    finally:
        for filler in fillers:
            filler.close()
        listener.close()
    assert isinstance(caught.value, asyncio.TimeoutError)
    assert not isinstance(caught.value, ReadTimeout)


async def test_a_reset_mid_answer_is_a_read_error_not_a_connect_error():
    async with raw_server(_reset_mid_answer) as port:
        with pytest.raises(ReadError) as caught:
            await _get(port)
    assert isinstance(caught.value, ConnectionResetError)  # what callers caught before
    assert not isinstance(caught.value, ConnectError)


async def test_a_connection_closed_before_any_answer_byte_is_a_stale_read_error():
    async with raw_server(_closes_silently) as port:
        with pytest.raises(StaleConnection) as caught:
            await _get(port)
    assert isinstance(caught.value, ReadError) and isinstance(caught.value, ConnectionResetError)


async def test_no_answer_in_time_is_a_read_timeout_and_still_an_asyncio_timeout():
    async with raw_server(_never_answers) as port:
        with pytest.raises(ReadTimeout) as caught:
            await _get(port, timeout=0.2)
    assert isinstance(caught.value, asyncio.TimeoutError)
    assert not isinstance(caught.value, ConnectTimeout)


@pytest.mark.parametrize(
    "handler, kind, words",
    [
        (_oversized, AnswerTooLarge, "declares 10000000000 bytes"),
        (_malformed, MalformedAnswer, "malformed HTTP answer"),
    ],
)
async def test_a_wrong_answer_is_a_protocol_error_and_still_a_runtime_error(handler, kind, words):
    async with raw_server(handler) as port:
        with pytest.raises(kind, match=words) as caught:
            await _get(port)
    assert isinstance(caught.value, ProtocolError) and isinstance(caught.value, RuntimeError)
    assert not isinstance(caught.value, OSError)  # the server answered: not a connection fault


KINDS = [
    raw.ConnectError,
    raw.PeerRefused,
    raw.ConnectTimeout,
    raw.ReadError,
    raw.StaleConnection,
    raw.ReadTimeout,
    raw.ProtocolError,
    raw.AnswerTooLarge,
    raw.MalformedAnswer,
]


def test_every_error_of_the_client_is_a_transport_error():
    assert all(issubclass(kind, TransportError) for kind in KINDS)


@pytest.mark.parametrize(
    "kind, expected",
    [
        (raw.ConnectError, httpx.ConnectError),
        (raw.PeerRefused, httpx.ConnectError),
        (raw.ConnectTimeout, httpx.ConnectTimeout),
        (raw.ReadError, httpx.ReadError),
        (raw.StaleConnection, httpx.ReadError),
        (raw.ReadTimeout, httpx.ReadTimeout),
        (raw.ProtocolError, httpx.RemoteProtocolError),
        (raw.AnswerTooLarge, httpx.RemoteProtocolError),
        (raw.MalformedAnswer, httpx.RemoteProtocolError),
    ],
)
def test_the_httpx_table_maps_each_kind(kind, expected):
    assert error_for(kind("x"), HTTPX_ERRORS) is expected


@pytest.mark.parametrize(
    "kind, expected",
    [
        (raw.ConnectError, ServerConnectionError),
        (raw.PeerRefused, ServerConnectionError),
        (raw.ConnectTimeout, ServerTimeoutError),
        (raw.ReadError, ServerReadError),
        (raw.StaleConnection, ServerReadError),
        (raw.ReadTimeout, ServerTimeoutError),
        (raw.ProtocolError, None),  # the server answered, wrongly: passes through
        (raw.AnswerTooLarge, None),
        (raw.MalformedAnswer, None),
    ],
)
def test_the_inference_table_maps_each_kind(kind, expected):
    assert error_for(kind("x"), CLIENT_ERRORS) is expected
    error = kind("x")
    if expected is None:
        with pytest.raises(kind):
            with mapped_errors("POST", "http://127.0.0.1:9/generate"):
                raise error
    else:
        with pytest.raises(expected) as caught:
            with mapped_errors("POST", "http://127.0.0.1:9/generate"):
                raise error
        assert type(caught.value) is expected


def test_the_most_specific_entry_wins_whatever_the_order_of_the_table():
    table = {raw.TransportError: "any", raw.ReadError: "read", raw.StaleConnection: "stale"}
    assert error_for(raw.StaleConnection("x"), table) == "stale"
    assert error_for(raw.ReadError("x"), dict(reversed(table.items()))) == "read"
    assert error_for(raw.ConnectError("x"), table) == "any"
    assert error_for(raw.ConnectError("x"), {raw.ReadError: "read"}) is None


async def test_a_reset_mid_answer_reaches_an_environment_as_a_read_error():
    """It was a ServerConnectionError saying the server could not be reached."""
    async with raw_server(_reset_mid_answer) as port:
        transport = JsonTransport(timeout=5)
        url = f"http://127.0.0.1:{port}/generate"
        with pytest.raises(ServerReadError, match="broke before its answer") as caught:
            await transport.post_json(url, {"prompt": "hi"})
        await transport.close()
    assert isinstance(caught.value, openai.APIConnectionError)
    assert isinstance(caught.value, ServerConnectionError)  # what callers caught before


async def test_a_reset_mid_answer_reaches_an_httpx_caller_as_a_read_error():
    async with raw_server(_reset_mid_answer) as port:
        async with httpx.AsyncClient(transport=RawHttpTransport()) as client:
            with pytest.raises(httpx.ReadError) as caught:
                await client.get(f"http://127.0.0.1:{port}/")
    assert type(caught.value) is httpx.ReadError


async def test_one_client_per_loop_made_anew_for_a_new_loop():
    made: list[RawHttpClient] = []

    def factory() -> RawHttpClient:
        made.append(RawHttpClient())
        return made[-1]

    clients = LoopClient(factory)
    assert clients.get() is clients.get() is made[0]

    async def in_another_loop() -> RawHttpClient:
        return clients.get()

    other = await asyncio.to_thread(asyncio.run, in_another_loop())
    assert other is made[1] and len(made) == 2
    assert clients.get() is made[2]  # the other loop's client is not used here
    clients.close()
    assert clients.get() is made[3]
    clients.close()
