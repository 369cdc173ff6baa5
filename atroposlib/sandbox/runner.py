"""Run untrusted programs in bubblewrap: stdin in; stdout, stderr, status and a reason out.

The isolation is :mod:`.command`'s; this module starts the run without blocking the event
loop (an asyncio subprocess), bounds its output while reading it, and at the deadline or
the output bound kills the program's whole process tree: the program runs in its own pid
namespace, and killing that namespace's first process makes the kernel kill every process
in it; :meth:`Sandbox.run` returns only once that process has ended (a pidfd says so), so
no process outlives the run, whether it ended on its own or was killed.

Example::

    sandbox = Sandbox(SandboxConfig(timeout_s=5))          # raises SandboxUnavailable here
    result = await sandbox.run_python("print(input()[::-1])", stdin="abc")
    result.stdout, result.reason                           # ("cba\\n", EndReason.OK)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
import weakref
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from atroposlib.sandbox.command import bwrap_argv
from atroposlib.sandbox.config import SandboxConfig
from atroposlib.sandbox.probe import check_bwrap, drop_privileges, resolve_python
from atroposlib.sandbox.result import EndReason, SandboxResult

logger = logging.getLogger(__name__)

__all__ = ["Sandbox"]

_CHUNK = 1 << 16
_DRAIN_S = 2.0  # how long the pipes may stay open once bubblewrap exited
_KILL_GRACE_S = 5.0  # how long bubblewrap may take to exit after its sandbox was killed
_BAD_NAME = ("/", "\0")

# A program that dies of an exception a limit raised: its last stderr line, and the reason.
_LAST_LINE_REASONS = (
    ("MemoryError", EndReason.MEMORY_LIMIT),
    ("[Errno 27] File too large", EndReason.FILE_SIZE_LIMIT),
    ("[Errno 28] No space left on device", EndReason.FILE_SIZE_LIMIT),
    ("BlockingIOError: [Errno 11] Resource temporarily unavailable", EndReason.PROCESS_LIMIT),
    ("can't start new thread", EndReason.PROCESS_LIMIT),
)


@dataclass
class _Stream:
    limit: int
    data: bytearray = field(default_factory=bytearray)
    truncated: bool = False


class Sandbox:
    """Runs programs under one :class:`SandboxConfig`; at most ``max_concurrency`` at once.

    Creating it checks that bubblewrap works here (:class:`SandboxUnavailable` otherwise,
    naming the fix). The same object may serve many concurrent runs from one event loop.
    """

    def __init__(self, config: SandboxConfig | None = None, *, max_concurrency: int | None = None):
        self.config = config or SandboxConfig()
        self.bwrap = check_bwrap(self.config)
        self.python, python_mounts = resolve_python(self.config)
        for path in self.config.ro_paths:
            if not os.path.exists(path):
                raise ValueError(f"SandboxConfig.ro_paths: {path!r} does not exist")
        self.ro_paths = [*python_mounts, *self.config.ro_paths]
        self.max_concurrency = max_concurrency or 2 * (os.cpu_count() or 1)
        self._semaphores: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore]
        self._semaphores = weakref.WeakKeyDictionary()

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        sem = self._semaphores.get(loop)
        if sem is None:
            sem = self._semaphores[loop] = asyncio.Semaphore(self.max_concurrency)
        return sem

    async def run_python(
        self,
        code: str,
        *,
        stdin: str | bytes = b"",
        args: Sequence[str] = (),
        files: Mapping[str, str | bytes] | None = None,
        timeout_s: float | None = None,
    ) -> SandboxResult:
        """Run ``code`` as ``/tmp/main.py`` with the sandbox's Python (see :meth:`run`)."""
        return await self.run(
            [self.python, "main.py", *args],
            stdin=stdin,
            files={**(files or {}), "main.py": code},
            timeout_s=timeout_s,
        )

    async def run(
        self,
        argv: Sequence[str],
        *,
        stdin: str | bytes = b"",
        files: Mapping[str, str | bytes] | None = None,
        timeout_s: float | None = None,
    ) -> SandboxResult:
        """Run ``argv`` in a fresh sandbox with ``stdin``; ``files`` are written to its /tmp first.

        ``timeout_s`` overrides the configured deadline (not the CPU limit) for this run.

        Raises:
            ValueError: stdin above ``max_input_bytes``, or a file name with a ``/``.
        """
        data = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
        if len(data) > self.config.max_input_bytes:
            raise ValueError(
                f"stdin: {len(data)} bytes is above the sandbox's max_input_bytes "
                f"({self.config.max_input_bytes})"
            )
        contents = {
            name: (value.encode() if isinstance(value, str) else bytes(value))
            for name, value in (files or {}).items()
        }
        for name in contents:
            if not name or any(c in name for c in _BAD_NAME) or name in (".", ".."):
                raise ValueError(f"files: {name!r} is not a plain file name")
        async with self._semaphore():
            return await self._run(list(argv), data, contents, timeout_s or self.config.timeout_s)

    def run_sync(self, argv: Sequence[str], **kwargs: object) -> SandboxResult:
        """:meth:`run` from synchronous code (not from inside a running event loop)."""
        return asyncio.run(self.run(argv, **kwargs))  # type: ignore[arg-type]

    async def _run(
        self, argv: list[str], stdin: bytes, files: dict[str, bytes], timeout_s: float
    ) -> SandboxResult:
        cfg = self.config
        info_r, info_w = os.pipe()
        file_fds = [_memfd(content) for content in files.values()]
        command = bwrap_argv(
            self.bwrap,
            cfg,
            argv,
            files=list(zip(file_fds, files, strict=True)),
            ro_paths=self.ro_paths,
            info_fd=info_w,
        )
        start = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *drop_privileges(cfg),
                *command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=(info_w, *file_fds),
                start_new_session=True,
            )
        except BaseException:
            os.close(info_r)
            raise
        finally:
            os.close(info_w)
            for fd in file_fds:
                os.close(fd)
        out, err = _Stream(cfg.max_output_bytes), _Stream(cfg.max_output_bytes)
        flooded = asyncio.Event()
        assert proc.stdout is not None and proc.stderr is not None
        readers = [
            asyncio.ensure_future(_read(proc.stdout, out, flooded)),
            asyncio.ensure_future(_read(proc.stderr, err, flooded)),
        ]
        writer = asyncio.ensure_future(_write(proc, stdin))
        info = asyncio.ensure_future(_child_pid(info_r))
        exited = asyncio.ensure_future(proc.wait())
        flood = asyncio.ensure_future(flooded.wait())
        killed_for: EndReason | None = None
        try:
            done, _ = await asyncio.wait(
                {exited, flood}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            if exited not in done:
                killed_for = EndReason.OUTPUT_LIMIT if flood in done else EndReason.TIMEOUT
                await _kill_tree(proc, info)
            await exited
        except BaseException:  # cancelled: the tree must not outlive the caller's wait
            with contextlib.suppress(Exception):
                await asyncio.shield(_kill_tree(proc, info))
            raise
        finally:
            flood.cancel()
            writer.cancel()
            _, pending = await asyncio.wait(readers, timeout=_DRAIN_S)
            for task in pending:
                task.cancel()
            # bubblewrap exited, so the info pipe is closed: this read ends at once.
            await asyncio.wait([info], timeout=_DRAIN_S)
            child = info.result() if info.done() and not info.cancelled() else None
            info.cancel()
            await _reap_namespace(child)
        duration = time.monotonic() - start
        reason, exit_code, signum = _classify(
            proc.returncode, killed_for, child is not None, err.data, out.truncated or err.truncated
        )
        return SandboxResult(
            stdout=out.data.decode(errors="replace"),
            stderr=err.data.decode(errors="replace"),
            reason=reason,
            exit_code=exit_code,
            signal=signum,
            duration_s=duration,
            timeout_s=timeout_s,
            max_output_bytes=cfg.max_output_bytes,
            stdout_truncated=out.truncated,
            stderr_truncated=err.truncated,
        )


def _memfd(content: bytes) -> int:
    fd = os.memfd_create("sandbox-file")
    try:
        view = memoryview(content)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


async def _read(stream: asyncio.StreamReader, into: _Stream, flooded: asyncio.Event) -> None:
    """Keep up to ``into.limit`` bytes; past it, flag the flood and keep draining the pipe."""
    while chunk := await stream.read(_CHUNK):
        room = into.limit - len(into.data)
        if len(chunk) > room:
            into.data += chunk[: max(room, 0)]
            into.truncated = True
            flooded.set()
        else:
            into.data += chunk


async def _write(proc: asyncio.subprocess.Process, data: bytes) -> None:
    assert proc.stdin is not None
    # A program that exits without reading its stdin closes the pipe: not an error.
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        if data:
            proc.stdin.write(data)
            await proc.stdin.drain()
        proc.stdin.close()


@dataclass
class _Child:
    """The sandbox's first process on the host: its pid, and a pidfd that stays bound to it."""

    pid: int
    pidfd: int | None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)

    async def wait_gone(self, timeout: float) -> bool:
        """Whether the process ended within ``timeout`` s (a pidfd is readable once it has).

        The first process of a pid namespace ends only after the kernel has killed and
        reaped every other process in it, so then nothing of the sandbox is left.
        """
        if self.pidfd is None:
            return True
        loop = asyncio.get_running_loop()
        gone = loop.create_future()
        loop.add_reader(self.pidfd, lambda: gone.done() or gone.set_result(None))
        try:
            await asyncio.wait_for(gone, timeout)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            loop.remove_reader(self.pidfd)

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


async def _child_pid(fd: int) -> _Child | None:
    """The sandbox's first process, from bubblewrap's ``--info-fd`` JSON (None: it failed
    before starting the sandbox)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    pipe = os.fdopen(fd, "rb", buffering=0)
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    try:
        text = await reader.readuntil(b"}")
        pid = int(json.loads(text)["child-pid"])
    except (asyncio.IncompleteReadError, ValueError, KeyError):
        return None
    finally:
        transport.close()
    try:
        return _Child(pid, os.pidfd_open(pid))
    except ProcessLookupError:  # already ended and reaped: its namespace is gone with it
        return _Child(pid, None)


async def _kill_tree(proc: asyncio.subprocess.Process, info: asyncio.Future) -> None:
    """Kill the sandbox's pid namespace (through its first process) and wait for bubblewrap.

    bubblewrap exits once that process is reaped, and the kernel reaps a namespace's first
    process only after every other process in it is gone.
    """
    child = info.result() if info.done() and not info.cancelled() else None
    if child is not None and proc.returncode is None:
        child.kill()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(proc.wait()), _KILL_GRACE_S)
    if proc.returncode is None:  # bubblewrap itself is stuck: its session goes, with it
        logger.warning("sandbox: bubblewrap (pid %d) did not exit; killing its session", proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


async def _reap_namespace(child: _Child | None) -> None:
    """Wait until nothing of the sandbox is left, killing what remains after a grace.

    When the program exits, bubblewrap reports its status and exits at once, while the
    namespace's first process may still be killing what the program left behind (a
    daemon): the run is not over before that process has ended.
    """
    if child is None:
        return
    try:
        if not await child.wait_gone(_KILL_GRACE_S):
            logger.warning("sandbox: namespace of pid %d outlived its program; killing", child.pid)
            child.kill()
            await child.wait_gone(_KILL_GRACE_S)
    finally:
        child.close()


def _classify(
    returncode: int | None,
    killed_for: EndReason | None,
    started: bool,
    stderr: bytes,
    truncated: bool,
) -> tuple[EndReason, int | None, int | None]:
    """``(reason, exit status, signal)`` of a finished run."""
    if killed_for is not None:
        return killed_for, None, signal.SIGKILL
    if truncated:  # the flood ended on its own before the kill: still over the bound
        return EndReason.OUTPUT_LIMIT, returncode, None
    code = returncode if returncode is not None else -1
    if not started and code != 0:
        return EndReason.SANDBOX_ERROR, code, None
    if code == 0:
        return EndReason.OK, 0, None
    # bubblewrap reports a child killed by signal N as status 128 + N.
    signum = code - 128 if 128 < code <= 128 + 64 else (-code if code < 0 else None)
    if signum is not None:
        if signum == signal.SIGXCPU:
            return EndReason.CPU_LIMIT, None, signum
        if signum == signal.SIGXFSZ:
            return EndReason.FILE_SIZE_LIMIT, None, signum
        return EndReason.SIGNAL, None, signum
    lines = stderr.decode(errors="replace").strip().splitlines()
    last = lines[-1] if lines else ""
    for marker, reason in _LAST_LINE_REASONS:
        if marker in last:
            return reason, code, None
    return EndReason.ERROR, code, None
