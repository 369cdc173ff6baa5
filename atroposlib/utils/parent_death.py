"""Helper processes that end with their parent, however the parent ends (kill -9 included).

A child that is busy (a scorer in a loop, a game blocked in C) never reads the end of its
stdin pipe, so it outlives a parent that dies without stopping it. On Linux the kernel can
signal a process when its parent exits (``prctl(PR_SET_PDEATHSIG)``); :func:`die_with_parent`
asks for that, from inside the child, and :func:`descendants_die_with_parent` arms every
process the child forks in turn, so a chain of processes goes down link by link.

Limits: elsewhere than Linux these are documented no-ops (they return False). The signal
comes when the *thread* that started the child exits, so a child should be started from
the thread that lives as long as the parent (the event loop's). A program the child starts
with ``exec`` (``subprocess``) keeps no Python at-fork hook: it must arm itself.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["PARENT_PID_ENV", "descendants_die_with_parent", "die_with_parent", "parent_pid_env"]

PARENT_PID_ENV = "ATROPOS_PARENT_PID"
"""The variable a parent sets to its pid for its child: a child whose parent already died
before it asked for the signal sees another parent pid and ends at once."""

_PR_SET_PDEATHSIG = 1
_forking_pid = 0  # the pid of the process that forks, read by its child after the fork


def parent_pid_env() -> dict[str, str]:
    """``{PARENT_PID_ENV: this pid}``: add it to a child's environment."""
    return {PARENT_PID_ENV: str(os.getpid())}


def die_with_parent(sig: int = signal.SIGKILL, parent_pid: int | None = None) -> bool:
    """Have the kernel send ``sig`` to this process when its parent exits (Linux).

    ``parent_pid`` (default: :data:`PARENT_PID_ENV` when set) is the parent expected: if
    this process already has another one, the parent died before the request and ``sig``
    is sent now. Returns whether the signal is armed (False off Linux, where nothing is done).
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if parent_pid is None:
        parent_pid = int(os.environ.get(PARENT_PID_ENV, "0") or 0) or None
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)  # orphaned already: nothing would ever signal us
    return True


def _remember_forking_pid() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def _arm_forked_child() -> None:
    die_with_parent(_signal_for_descendants, _forking_pid)


_signal_for_descendants = signal.SIGKILL
_hooked = False


def descendants_die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """:func:`die_with_parent` for this process, and for every process it (or they) fork
    from Python (``os.fork``, ``multiprocessing``'s fork start method): each dies when its
    own parent does, so the whole tree ends with the first parent. Returns whether armed."""
    global _signal_for_descendants, _hooked
    armed = die_with_parent(sig)
    if armed and not _hooked:
        _signal_for_descendants = sig
        os.register_at_fork(before=_remember_forking_pid, after_in_child=_arm_forked_child)
        _hooked = True
    return armed
