"""One socket write per answer: the coalescing transport and run-api served through it."""

from __future__ import annotations

import asyncio
import pickle
import socket
from typing import List

import httpx

from atroposlib.http.transport import CoalescingTransport, http_protocol
from atroposlib.testing.launch import run_api_cmd
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import running_process
from tests.api.conftest import TRAINER, start_api


class _Recording:
    """A stand-in transport that records calls."""

    def __init__(self) -> None:
        self.calls: List[tuple] = []
        self.closing = False

    def writelines(self, lines) -> None:
        self.calls.append(("writelines", list(lines)))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.calls.append(("close",))
        self.closing = True

    def abort(self) -> None:
        self.calls.append(("abort",))
        self.closing = True

    def write_eof(self) -> None:
        self.calls.append(("write_eof",))

    def get_write_buffer_size(self) -> int:
        return 7

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 1) if name == "peername" else default


def test_writes_of_one_loop_turn_leave_together_and_in_order():
    async def main():
        real = _Recording()
        t = CoalescingTransport(real, asyncio.get_running_loop())
        t.write(b"HTTP/1.1 200 OK\r\n\r\n")
        t.write(b"")
        t.writelines([b"body", b"-more"])
        assert real.calls == [] and t.get_write_buffer_size() == 7 + 19 + 9
        await asyncio.sleep(0)
        assert real.calls == [("writelines", [b"HTTP/1.1 200 OK\r\n\r\n", b"body", b"-more"])]
        t.write(b"next")
        await asyncio.sleep(0)
        assert real.calls[-1] == ("writelines", [b"next"])
        assert t.get_extra_info("peername") == ("127.0.0.1", 1)  # the rest is the transport's

    asyncio.run(main())


def test_close_sends_what_is_pending_first_and_abort_drops_it():
    async def main():
        real = _Recording()
        t = CoalescingTransport(real, asyncio.get_running_loop())
        t.write(b"last answer")
        t.close()
        assert real.calls == [("writelines", [b"last answer"]), ("close",)]
        await asyncio.sleep(0)  # the scheduled flush finds nothing more to send
        assert len(real.calls) == 2

        real = _Recording()
        t = CoalescingTransport(real, asyncio.get_running_loop())
        t.write(b"never sent")
        t.abort()
        await asyncio.sleep(0)
        assert real.calls == [("abort",)]

        real = _Recording()
        t = CoalescingTransport(real, asyncio.get_running_loop())
        t.write(b"tail")
        t.write_eof()
        assert real.calls == [("writelines", [b"tail"]), ("write_eof",)]

    asyncio.run(main())


def test_http_protocol_is_uvicorns_httptools_protocol_and_pickles():
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    protocol = http_protocol()
    assert issubclass(protocol, HttpToolsProtocol)
    # uvicorn --reload / --workers hand the config to a spawned process by pickling it
    assert pickle.loads(pickle.dumps(protocol)) is protocol


def _raw_exchange(port: int, request: bytes, answers: int) -> List[bytes]:
    """Send ``request`` on one socket and read ``answers`` whole answers; each recv's bytes."""
    chunks: List[bytes] = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        data = b""
        while data.count(b"HTTP/1.1 ") < answers or not data.endswith(b"}"):
            chunk = s.recv(65536)
            assert chunk, data
            chunks.append(chunk)
            data += chunk
    return chunks


def test_run_api_answers_in_one_segment_and_keeps_pipelined_order(tmp_path):
    ctx, url = start_api(tmp_path)
    port = int(url.rsplit(":", 1)[1])
    with ctx, httpx.Client(base_url=url, timeout=10) as c:
        assert c.post("/register", json=TRAINER).status_code == 200
        one = b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        chunks = _raw_exchange(port, one, 1)
        assert len(chunks) == 1 and chunks[0].startswith(b"HTTP/1.1 200")  # head and body together
        chunks = _raw_exchange(port, one * 3, 3)
        answers = b"".join(chunks).split(b"HTTP/1.1 ")[1:]
        assert len(answers) == 3 and all(a.startswith(b"200") for a in answers)
        assert c.get("/health").json() == {"status": "ok"}


def test_run_api_reload_starts_with_the_protocol_and_answers(tmp_path):
    """``--reload`` hands uvicorn's config (naming the protocol class) to a spawned process."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = run_api_cmd(port, "--reload")
    with running_process(
        cmd, health_url=f"{url}/health", cwd=tmp_path, log_path=tmp_path / "api.log"
    ):
        r = httpx.post(f"{url}/register", json=TRAINER, timeout=10)
        assert r.status_code == 200 and "uuid" in r.json()
