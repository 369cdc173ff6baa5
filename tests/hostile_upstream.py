"""A hostile (or broken) inference server for tests, run as a process.

It answers ``GET /health`` with 200 and every other request according to its current mode,
set with ``POST /mode`` and a JSON body ``{"mode": NAME, ...parameters}``:

- ``generate``: a valid vLLM ``/generate`` answer whose output is ``token_ids``;
- ``chunked``: the same answer, sent with chunked framing in ``chunk``-byte chunks, with a
  ``padding`` field of ``pad`` bytes (to make the answer long);
- ``huge_length``: ``Content-Length: 10**12``, then ``mb`` megabytes of body, then close;
- ``stream_close``: no length, ``mb`` megabytes of body, then close;
- ``endless_headers``: a status line and ``mb`` megabytes of header lines with no end;
- ``raw``: ``status``, ``headers`` and ``body`` (a string) as given (redirects, 401s,
  bodies that are not JSON or not the protocol).

``GET /stats`` reports the requests answered per mode. Every answer closes its connection.

    python -m tests.hostile_upstream --port 9123
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import httpx

from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import start_process, stop_process, wait_http

MB = 1024 * 1024
HOSTILE = [sys.executable, "-m", "tests.hostile_upstream"]


class Upstream:
    """A running hostile upstream process, as the tests drive it."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    def mode(self, **settings: object) -> None:
        httpx.post(f"{self.url}/mode", json=settings, timeout=5).raise_for_status()

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/stats", timeout=5).json()


@contextlib.contextmanager
def running_upstream(
    host: str = "127.0.0.1", log_path: str | Path | None = None
) -> Iterator[Upstream]:
    """Run the hostile upstream on a free port of ``host`` for the duration of the block,
    answering ``/health`` on entry."""
    port = free_port()
    proc = start_process([*HOSTILE, "--host", host, "--port", str(port)], log_path=log_path)
    upstream = Upstream(host, port)
    try:
        wait_http(f"{upstream.url}/health", timeout=30, proc=proc)
        yield upstream
    finally:
        stop_process(proc)


STATE: dict[str, Any] = {"mode": "generate", "token_ids": [97, 98]}
STATS: Counter[str] = Counter()


def _generate_answer(extra: dict[str, Any] | None = None) -> bytes:
    ids = list(STATE.get("token_ids") or [])
    n = int(STATE.get("n", 1))
    body: dict[str, Any] = {
        "text": [""] * n,
        "token_ids": [ids] * n,
        "logprobs": [[[{str(t): -0.5}] for t in ids]] * n,
        "finish_reasons": ["stop"] * n,
    }
    body.update(extra or {})
    return json.dumps(body).encode()


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
    body = await reader.readexactly(length) if length else b""
    return method, target, body


def _answer(status: int, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    head = [f"HTTP/1.1 {status} X", f"Content-Length: {len(body)}", "Connection: close"]
    head += [f"{k}: {v}" for k, v in (headers or {"Content-Type": "application/json"}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


async def _stream(writer: asyncio.StreamWriter, head: bytes, megabytes: float) -> None:
    writer.write(head)
    block = b"x" * 65536
    for _ in range(int(megabytes * MB / len(block))):
        writer.write(block)
        await writer.drain()


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        method, target, body = await _read_request(reader)
        if target == "/health" or target.endswith("/health"):
            writer.write(_answer(200, b"{}"))
        elif target == "/mode":
            STATE.clear()
            STATE.update(json.loads(body))
            writer.write(_answer(200, b"{}"))
        elif target == "/stats":
            writer.write(_answer(200, json.dumps(dict(STATS)).encode()))
        else:
            mode = STATE["mode"]
            STATS[mode] += 1
            mb = float(STATE.get("mb", 8))
            if mode == "generate":
                writer.write(_answer(200, _generate_answer()))
            elif mode == "chunked":
                payload = _generate_answer({"padding": "p" * int(STATE.get("pad", 0))})
                size = int(STATE.get("chunk", 1))
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                for start in range(0, len(payload), 65536):
                    piece = payload[start : start + 65536]
                    framed = b"".join(
                        b"%x\r\n%s\r\n" % (len(piece[i : i + size]), piece[i : i + size])
                        for i in range(0, len(piece), size)
                    )
                    writer.write(framed)
                    await writer.drain()
                writer.write(b"0\r\n\r\n")
            elif mode == "huge_length":
                await _stream(
                    writer, b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000000\r\n\r\n", mb
                )
            elif mode == "stream_close":
                await _stream(writer, b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n", mb)
            elif mode == "endless_headers":
                writer.write(b"HTTP/1.1 200 OK\r\n")
                line = b"X-Pad: " + b"y" * 1000 + b"\r\n"
                for _ in range(int(mb * MB / len(line))):
                    writer.write(line)
                    await writer.drain()
            elif mode == "raw":
                raw_body = str(STATE.get("body", "")).encode("utf-8", "surrogatepass")
                writer.write(_answer(int(STATE["status"]), raw_body, STATE.get("headers")))
        await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass  # the client gave up (as it should, for the oversized answers)
    finally:
        writer.close()


async def _main(host: str, port: int) -> None:
    server = await asyncio.start_server(_handle, host, port, limit=1 << 20)
    async with server:
        await server.serve_forever()


def main() -> None:
    """``python -m tests.hostile_upstream --port N [--host H]``."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    asyncio.run(_main(args.host, args.port))


if __name__ == "__main__":
    main()
