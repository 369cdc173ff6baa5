"""A real env process against a real run-api, behind a forwarder that answers some calls itself:
unusable ``/status-env`` answers are failed polls (the env recovers and posts), and a status
poll task that dies stops the env with its error instead of leaving it waiting for ever.
"""

from __future__ import annotations

import asyncio
import subprocess
import threading
from pathlib import Path
from typing import Callable, Iterator

import pytest

from atroposlib.testing.launch import run_api_cmd as api_cmd
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import running_process, start_process, stop_process
from atroposlib.testing.trainer import FakeTrainer

from .serve_helpers import env_cmd, fake_server_cmd

GROUP_SIZE = 4
BATCH_SIZE = 8

Rule = Callable[[str, str], "bytes | None"]
"""``rule(method, target)``: a raw answer to send instead of forwarding, or None."""


def raw_answer(status: int, body: bytes, content_type: str = "application/json") -> bytes:
    """One complete HTTP/1.1 answer with ``body``."""
    head = (
        f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode("latin-1") + body


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0


class Forwarder:
    """Forwards HTTP/1.1 requests (``Content-Length`` bodies) to ``127.0.0.1:upstream``,
    except those ``rule`` answers itself; runs its own event loop in a thread."""

    def __init__(self, upstream: int, rule: Rule) -> None:
        self.upstream, self.rule = upstream, rule
        self.port = 0
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        started.set()
        self.loop.run_forever()
        server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                body = await reader.readexactly(_content_length(head))
                method, target = head.split(b" ", 2)[:2]
                canned = self.rule(method.decode(), target.decode())
                if canned is None:
                    if upstream is None:
                        upstream = await asyncio.open_connection("127.0.0.1", self.upstream)
                    upstream[1].write(head + body)
                    answer_head = await upstream[0].readuntil(b"\r\n\r\n")
                    canned = answer_head + await upstream[0].readexactly(
                        _content_length(answer_head)
                    )
                writer.write(canned)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            if upstream is not None:
                upstream[1].close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def inference_port(tmp_path_factory) -> Iterator[int]:
    port = free_port()
    with running_process(
        fake_server_cmd(port, latency_ms=5),
        health_url=f"http://127.0.0.1:{port}/health",
        log_path=tmp_path_factory.mktemp("fake") / "fake.log",
    ):
        yield port


def _run_env(tmp_path: Path, inference_port: int, rule: Rule, timeout: float) -> tuple[int, str]:
    """run-api, a trainer, and the trivial env talking to run-api through a forwarder with
    ``rule``; the env's exit status and log."""
    api_port = free_port()
    env_log = tmp_path / "env.log"
    with running_process(
        api_cmd(api_port),
        health_url=f"http://127.0.0.1:{api_port}/health",
        log_path=tmp_path / "api.log",
    ):
        trainer = FakeTrainer(api_port, BATCH_SIZE, num_steps=3)
        trainer.register()
        trainer.start()
        forwarder = Forwarder(api_port, rule)
        try:
            env = start_process(
                env_cmd("serve", forwarder.port, inference_port, "--env.total_steps", "3"),
                log_path=env_log,
                env={"ATROPOS_OUTBOX_DIR": str(tmp_path / "outbox")},
            )
            try:
                code = env.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                stop_process(env)
                raise AssertionError(
                    f"env still running after {timeout}s:\n{env_log.read_text()[-3000:]}"
                ) from None
        finally:
            forwarder.close()
            trainer.stop()
        trainer.drain()
        assert code != 0 or len(trainer.batches) >= 3, env_log.read_text()[-3000:]
    return code, env_log.read_text()


BAD_STATUS_ANSWERS = [
    raw_answer(200, b"<html>not a status</html>", "text/html"),
    raw_answer(200, b"\xff\xfe garbage"),
    raw_answer(200, b"[1, 2]"),
    raw_answer(200, b'{"current_step": "soon", "queue_size": 0}'),
    raw_answer(200, b'{"queue_size": true}'),
    raw_answer(200, b'{"unallocated_fraction": NaN}'),
]


def test_unusable_status_answers_are_failed_polls_and_the_env_recovers(tmp_path, inference_port):
    """Today's code lost its status poll to the first non-JSON 200 and never posted again."""
    bad = list(BAD_STATUS_ANSWERS)

    def rule(method: str, target: str) -> bytes | None:
        if target.startswith("/status-env") and bad:
            return bad.pop(0)
        return None

    code, log = _run_env(tmp_path, inference_port, rule, timeout=60)
    assert code == 0, log[-3000:]
    assert not bad
    assert "enough data queued for total_steps=3" in log
    assert "status-env answer unusable (1 in a row)" in log
    assert "b'<html>not a status</html>'" in log  # the answer's first bytes
    assert "failed status-env polls by kind: {'bad_answer': 6}" in log
    assert "never retrieved" not in log


def test_a_status_poll_task_that_dies_stops_the_env_with_its_error(tmp_path, inference_port):
    """The poll re-registers on a 404; a refused re-registration ends its task. Today's
    env then waited for ever with no log line; now it exits with that error."""
    registrations: list[str] = []

    def rule(method: str, target: str) -> bytes | None:
        if target.startswith("/status-env"):
            return raw_answer(404, b'{"detail": "unknown env_id"}')
        if target.startswith("/register-env"):
            registrations.append(target)
            if len(registrations) > 1:
                return raw_answer(400, b'{"detail": "no more environments"}')
        return None

    code, log = _run_env(tmp_path, inference_port, rule, timeout=60)
    assert code != 0
    assert "the status-poll task died: RuntimeError: register-env refused" in log, log[-3000:]
    assert "no more environments" in log
    assert "never retrieved" not in log
