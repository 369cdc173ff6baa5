"""Processes of a run end with the run: parent-death signals, a stop flag, a bounded exit.

Several mechanisms, because each covers a case the others cannot:

- :func:`die_with_parent` asks the kernel to send SIGTERM when the parent dies
  (``PR_SET_PDEATHSIG``), so even ``kill -9`` of a parent reaches its children. The
  launcher sets it in every child; trainer ranks set it in themselves, because
  ``torchrun`` starts each rank in a new session without it.
- :func:`install` (called by every trainer process) turns SIGTERM, SIGINT and SIGHUP into
  ``SystemExit`` in the main thread, so ``finally`` blocks stop what the process owns, and
  sets a stop flag (:func:`stopping`) that waiting threads check. A main thread blocked
  inside a C call (a gloo collective) never runs a Python signal handler, so a watchdog
  thread also learns of the signal (through the interpreter's wake-up fd) and of the
  parent's death (the parent pid changes), and ends the process ``grace`` seconds later
  if it is still there, killing its own children first.
- :func:`descendants` lists a process's descendants from ``/proc``, so the launcher can
  sweep processes that left its children's process groups (torchrun's ranks).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Dict, List

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# Environment variable set by the launcher: its children and their ranks die with their parent.
DIE_WITH_PARENT_ENV = "ATROPOS_DIE_WITH_PARENT"

_stop = threading.Event()
_exiting = False
_installed = False


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux only).

    Safe between fork and exec (``preexec_fn``). Returns False where unsupported.
    """
    return _prctl(_PR_SET_PDEATHSIG, int(sig))


def become_subreaper() -> bool:
    """Make orphaned descendants of this process its children rather than init's.

    A launcher that is a subreaper can still find (and stop) a grandchild whose parent
    died first, e.g. a trainer rank after ``torchrun`` exited.
    """
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def stopping() -> bool:
    """True once this process was asked to stop (signal, or parent gone)."""
    return _stop.is_set()


def _on_signal(signum: int, frame: object) -> None:
    global _exiting
    _stop.set()
    if _exiting:
        # A second signal must not interrupt the cleanup of the first (the watchdog bounds it).
        return
    _exiting = True
    raise SystemExit(128 + signum)


def install(grace: float = 15.0, watch_parent: bool | None = None) -> None:
    """Stop on SIGTERM/SIGINT/SIGHUP (and on the parent's death), within ``grace`` seconds.

    Call once, from the main thread, before starting work. ``watch_parent`` (default:
    under ``torchrun`` or the launcher) also makes the process stop when its parent
    dies; a trainer started by hand from a shell keeps running when that shell exits.
    """
    global _installed
    if _installed:
        return
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("supervision.install must be called from the main thread")
    if watch_parent is None:
        watch_parent = (
            "TORCHELASTIC_RUN_ID" in os.environ or os.environ.get(DIE_WITH_PARENT_ENV) == "1"
        )
    parent = os.getppid() if watch_parent else None
    if watch_parent:
        die_with_parent()
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    writer.setblocking(False)
    # The C-level handler writes each signal number here at once, even while the main
    # thread sits in a C call; the Python handler itself runs only when that call returns.
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    for sig in _STOP_SIGNALS:
        signal.signal(sig, _on_signal)
    threading.Thread(
        target=_watch, args=(reader, writer, parent, grace), name="stop-watchdog", daemon=True
    ).start()
    _installed = True


def _watch(reader: socket.socket, writer: socket.socket, parent: int | None, grace: float) -> None:
    deadline: float | None = None
    while True:
        wait = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
        ready, _, _ = select.select([reader], [], [], wait)
        if ready:
            with contextlib.suppress(BlockingIOError, InterruptedError):
                data = reader.recv(256)
                if any(b in data for b in (int(s) for s in _STOP_SIGNALS)):
                    _stop.set()
        if parent is not None and os.getppid() != parent:
            logger.warning("parent process %d is gone; stopping", parent)
            parent = None
            _stop.set()
            # Lets the main thread's handler run cleanup where it can (SystemExit).
            os.kill(os.getpid(), signal.SIGTERM)
        if deadline is None and _stop.is_set():
            logger.warning("asked to stop; exiting within %.0fs", grace)
            deadline = time.monotonic() + grace
        if deadline is not None and time.monotonic() >= deadline:
            _hard_exit(grace)


def _hard_exit(grace: float) -> None:
    logger.error("did not stop within %.0fs of being asked to; exiting now", grace)
    kill_tree(os.getpid(), signal.SIGKILL, include_root=False)
    logging.shutdown()
    os._exit(128 + signal.SIGTERM)


def _children_map() -> Dict[int, List[int]]:
    kids: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1 and fields[0] != b"Z":
            kids.setdefault(int(fields[1]), []).append(int(entry))
    return kids


def descendants(pid: int) -> List[int]:
    """Pids of every live (non-zombie) descendant of ``pid``, parents before children.

    Reads ``/proc``; empty where there is none.
    """
    if not os.path.isdir("/proc"):
        return []
    kids = _children_map()
    out: List[int] = []
    todo = list(kids.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return not os.path.isdir("/proc")
    return stat[stat.rfind(b")") + 2 :][:1] != b"Z"


def reap(pid: int) -> None:
    """Collect ``pid``'s exit status if it is (or became, as a subreaper) our child."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def kill_tree(pid: int, sig: int, include_root: bool = True) -> List[int]:
    """Send ``sig`` to ``pid``'s descendants (and ``pid``); returns the pids signalled."""
    targets = descendants(pid) + ([pid] if include_root else [])
    for p in targets:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, sig)
    return targets
