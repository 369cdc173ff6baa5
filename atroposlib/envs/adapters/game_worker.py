"""Text games in worker processes, where a step that hangs can be killed.

A game step is the game's own code: it may loop in Python, sleep in C, or backtrack in
``re`` while holding the GIL. A thread cannot stop the last two, and while one holds the
GIL the event loop (every other episode, the status poll) stands still. So each game
runs in a worker process: :class:`ProcessGame` is an :class:`AsyncTextGame` whose calls
go to a worker over a pipe; a call that is cancelled (its time limit passed, or its
episode stopped) kills the worker, and the episode ends without the parent holding any
lock. :class:`GameWorkerPool` keeps finished workers for the next game (a fresh one
costs an interpreter start and the game library's import) and replaces killed ones.

The worker is this module run as ``python -m atroposlib.envs.adapters.game_worker``: it
builds one game at a time from a picklable factory and answers calls on it. It exits
when its parent's pipe closes, and (on Linux) when its parent dies mid-step.

Frames both ways are a 4-byte big-endian length and a pickle; the worker's stdout is
reserved for them (a game's ``print`` goes to stderr).
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
from typing import Any, BinaryIO, Callable, List

from atroposlib.envs.adapters.text_game_types import AsyncTextGame, StepResult, TextGame, Turn
from atroposlib.utils.aio import within
from atroposlib.utils.parent_death import die_with_parent

logger = logging.getLogger(__name__)

__all__ = [
    "START_TIMEOUT_S",
    "GameWorker",
    "GameWorkerDied",
    "GameWorkerPool",
    "ProcessGame",
    "in_worker",
    "shared_pool",
]

START_TIMEOUT_S = 120.0
"""Longest a worker may take to start and build a game (an interpreter start plus the game
library's import, a few seconds on a loaded machine)."""

CLOSE_TIMEOUT_S = 5.0
"""Longest a game's ``close`` may take in its worker before the worker is killed."""

_HEADER = struct.Struct(">I")


class GameWorkerDied(RuntimeError):
    """The worker process ended (or was killed) before it answered."""


# ------------------------------------------------------------------ parent side


class GameWorker:
    """One worker process and its pipes; one call at a time.

    The pipes are non-blocking and waited on with the calling event loop's reader and
    writer callbacks, registered for one call only: no thread, no child watcher, and no
    tie to an event loop, so an idle worker serves the next ``asyncio.run`` too (the
    process-wide pool of :func:`shared_pool`).
    """

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.dead = False
        assert proc.stdin is not None and proc.stdout is not None
        self._to = proc.stdin.fileno()
        self._from = proc.stdout.fileno()
        os.set_blocking(self._to, False)
        os.set_blocking(self._from, False)
        self._buffer = bytearray()

    @property
    def pid(self) -> int:
        """The worker's process id."""
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """The worker's exit status once it ended and was reaped (None while it runs)."""
        return self.proc.poll()

    @classmethod
    async def spawn(cls) -> GameWorker:
        """Start a worker; it can import what this process can (``sys.path`` is sent)."""
        proc = subprocess.Popen(
            [sys.executable, "-m", __name__, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        worker = cls(proc)
        await worker.call("path", list(sys.path))
        return worker

    async def call(self, op: str, *args: Any) -> Any:
        """Run ``op`` in the worker: its answer, or the error it raised. Cancelled or cut
        off mid-call, the worker is killed (its state is unknown) and stays dead."""
        if self.dead:
            raise GameWorkerDied(f"game worker {self.pid} was stopped")
        data = pickle.dumps((op, args))
        try:
            await self._write(_HEADER.pack(len(data)) + data)
            (size,) = _HEADER.unpack(await self._read(_HEADER.size))
            status, value = pickle.loads(await self._read(size))
        except (EOFError, OSError) as err:
            self.kill()
            raise GameWorkerDied(
                f"game worker {self.pid} exited while running {op!r} (exit code {self.proc.poll()})"
            ) from err
        except BaseException:  # cancelled (a time limit) or an unreadable answer
            self.kill()
            raise
        if status == "err":
            raise value
        return value

    async def _ready(self, fd: int, writing: bool) -> None:
        """Until ``fd`` can be written (or read) without blocking."""
        loop = asyncio.get_running_loop()
        ready = loop.create_future()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        if writing:
            loop.add_writer(fd, wake)
        else:
            loop.add_reader(fd, wake)
        try:
            await ready
        finally:
            (loop.remove_writer if writing else loop.remove_reader)(fd)

    async def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self._to, view) :]
            except BlockingIOError:
                await self._ready(self._to, writing=True)

    async def _read(self, size: int) -> bytes:
        while len(self._buffer) < size:
            try:
                chunk = os.read(self._from, max(size - len(self._buffer), 1 << 16))
            except BlockingIOError:
                await self._ready(self._from, writing=False)
                continue
            if not chunk:
                raise EOFError(
                    f"the worker's pipe closed after {len(self._buffer)} of {size} bytes"
                )
            self._buffer += chunk
        out = bytes(self._buffer[:size])
        del self._buffer[:size]
        return out

    def kill(self) -> None:
        """SIGKILL the worker and close its pipes (no wait: :meth:`reap` collects it)."""
        if self.dead:
            return
        self.dead = True
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()

    async def reap(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Kill the worker and wait until it is reaped (polled: no thread waits on it)."""
        self.kill()
        for _ in range(int(timeout / _REAP_POLL_S)):
            if self.proc.poll() is not None:
                return
            await asyncio.sleep(_REAP_POLL_S)


_REAP_POLL_S = 0.01


class GameWorkerPool:
    """Workers of one event loop: an idle one is reused, a killed one is replaced.

    It keeps as many idle workers as were ever busy at once (the environment's peak of
    concurrent episodes), and :meth:`close` stops and reaps them all. Its workers serve any
    event loop (see :class:`GameWorker`); ``loop`` is the one it was made in.
    """

    def __init__(self) -> None:
        try:
            self.loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = None
        self._idle: List[GameWorker] = []
        self._all: List[GameWorker] = []
        self._closed = False
        self._lock = threading.Lock()  # the shared pool may serve loops in several threads

    @property
    def pids(self) -> List[int]:
        """Process ids of the workers not yet reaped."""
        with self._lock:
            return [w.pid for w in self._all if w.returncode is None]

    async def acquire(self) -> GameWorker:
        """An idle worker, or a new one."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the game worker pool is closed")
            self._all = [w for w in self._all if w.returncode is None]
            while self._idle:
                worker = self._idle.pop()
                if not worker.dead and worker.returncode is None:
                    return worker
        worker = await GameWorker.spawn()
        with self._lock:
            self._all.append(worker)
        return worker

    def release(self, worker: GameWorker) -> None:
        """Give ``worker`` back: kept for the next game unless it was killed."""
        with self._lock:
            if worker.dead or self._closed or worker.returncode is not None:
                worker.kill()
                return
            self._idle.append(worker)

    async def close(self) -> None:
        """Kill every worker and wait until each is reaped."""
        with self._lock:
            self._closed = True
            self._idle.clear()
            workers, self._all = self._all, []
        await asyncio.gather(*(w.reap() for w in workers), return_exceptions=True)

    def abandon(self) -> None:
        """Kill every worker without waiting (the pool's event loop is gone)."""
        with self._lock:
            self._closed = True
            workers, self._all, self._idle = self._all, [], []
        for worker in workers:
            worker.kill()


_shared: GameWorkerPool | None = None
_shared_lock = threading.Lock()


def shared_pool() -> GameWorkerPool:
    """The process-wide pool :func:`~atroposlib.envs.adapters.text_games.play_episode` runs a
    plain :class:`TextGame` in when it is given none: its idle workers serve every later
    episode, in any event loop; they are killed when this process exits (or by
    ``await shared_pool().close()``, after which a new pool is made)."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared._closed:
            _shared = GameWorkerPool()
            atexit.register(_shared.abandon)
        return _shared


async def in_worker(game: TextGame, pool: GameWorkerPool | None = None) -> ProcessGame | TextGame:
    """``game`` moved into a worker process of ``pool`` (default :func:`shared_pool`), where a
    step that overruns its limit is killed instead of holding a thread (or, stuck in C with
    the GIL, the event loop). The game is pickled as it is now; the caller's object is left
    as it was.

    A game the worker cannot rebuild (unpicklable state, or a class the worker cannot
    import, such as one defined in the ``__main__`` script) is returned as it is, with a
    warning: its steps then run in a thread, which cannot stop one blocked in C.
    """
    try:
        if type(game).__module__ == "__main__":
            raise pickle.PicklingError("its class is defined in __main__, which workers do not run")
        payload = pickle.dumps(game)
        factory = functools.partial(pickle.loads, payload)
        return await ProcessGame(pool or shared_pool(), factory, game.num_players).start()
    except (GameWorkerDied, asyncio.TimeoutError):
        raise  # the worker, not the game: nothing a thread would do better
    except Exception as err:  # pickling here or rebuilding there failed: any error type
        logger.warning(
            "text game %s cannot run in a worker process (%s: %s): its steps run in a thread, "
            "where one stuck in C is never stopped and can freeze the event loop; define it "
            "in an importable module, with picklable state",
            type(game).__name__,
            type(err).__name__,
            err,
        )
        return game


class ProcessGame(AsyncTextGame):
    """A game built by ``factory`` (picklable, called in the worker) in a pool's worker.

    :meth:`start` takes a worker and builds the game (bounded by ``start_timeout_s``);
    ``reset``/``step`` are bounded by whoever awaits them (``play_episode``'s step limit),
    and a cancelled call kills the worker; ``close`` gives a live worker back.
    """

    def __init__(
        self,
        pool: GameWorkerPool,
        factory: Callable[[], TextGame],
        num_players: int = 1,
        start_timeout_s: float = START_TIMEOUT_S,
    ):
        self.pool = pool
        self.factory = factory
        self.num_players = num_players
        self.start_timeout_s = start_timeout_s
        self.worker: GameWorker | None = None

    async def start(self) -> ProcessGame:
        """Take a worker and build the game in it."""
        payload = pickle.dumps(self.factory)  # an unpicklable factory fails here, named
        taken: List[GameWorker] = []

        async def build() -> GameWorker:
            worker = await self.pool.acquire()
            taken.append(worker)
            await worker.call("make", payload)
            return worker

        try:
            self.worker = await within(build(), self.start_timeout_s)
        except BaseException:
            for worker in taken:
                self.pool.release(worker)  # kept when the game's constructor raised
            raise
        return self

    def _live(self) -> GameWorker:
        if self.worker is None:
            raise RuntimeError("ProcessGame: call start() first")
        return self.worker

    async def reset(self, seed: int) -> Turn:
        """The game's ``reset(seed)`` in its worker."""
        return await self._live().call("reset", seed)

    async def step(self, text: str) -> StepResult:
        """The game's ``step(text)`` in its worker."""
        return await self._live().call("step", text)

    async def close(self) -> None:
        """Close the game and give its worker back (a dead or stuck one is dropped)."""
        worker, self.worker = self.worker, None
        if worker is None:
            return
        if not worker.dead:
            try:
                await within(worker.call("drop"), CLOSE_TIMEOUT_S)
            except Exception:  # a close that fails or hangs costs the worker, nothing else
                worker.kill()
                raise
            finally:
                self.pool.release(worker)
        else:
            self.pool.release(worker)


# ------------------------------------------------------------------ worker side


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this process when its parent dies, even mid-step (the pipe's end is
    seen only between calls); elsewhere, exit now if the parent is already gone."""
    try:
        armed = die_with_parent(signal.SIGKILL, parent_pid=parent)
    except OSError:
        armed = False
    if not armed and os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(0)


def _read_frame(stream: BinaryIO) -> bytes | None:
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(head)
    body = stream.read(size)
    return body if len(body) == size else None


def _answer(game: Any, op: str, args: tuple) -> tuple[Any, Any]:
    """Run one call; returns (the game now, the answer)."""
    if op == "path":
        sys.path[:0] = [p for p in args[0] if p not in sys.path]
        return game, None
    if op == "make":
        return pickle.loads(args[0])(), None
    if op == "drop":
        if game is not None:
            game.close()
        return None, None
    if op in ("reset", "step"):
        if game is None:
            raise RuntimeError(f"{op} before a game was made")
        return game, getattr(game, op)(*args)
    raise ValueError(f"unknown game worker call {op!r}")


def main(argv: List[str] | None = None) -> None:
    """The worker: answer calls from stdin until it closes."""
    argv = sys.argv[1:] if argv is None else argv
    _die_with_parent(int(argv[0]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    frames_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a game's print() must not corrupt the frames
    sys.stdout = sys.stderr
    frames_in = sys.stdin.buffer
    game: Any = None
    while True:
        frame = _read_frame(frames_in)
        if frame is None:
            return  # the parent closed the pipe (or died)
        try:
            op, args = pickle.loads(frame)
            game, value = _answer(game, op, args)
            reply = pickle.dumps(("ok", value))
        except Exception as err:  # handed to the caller
            try:
                reply = pickle.dumps(("err", err))
            except Exception:  # an error that does not pickle: its text
                reply = pickle.dumps(("err", RuntimeError(f"{type(err).__name__}: {err}")))
        frames_out.write(_HEADER.pack(len(reply)) + reply)
        frames_out.flush()


if __name__ == "__main__":
    main()
