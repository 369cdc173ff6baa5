"""Checks made once, when a sandbox is created: bubblewrap runs here, and as whom.

A sandbox that cannot isolate code raises :class:`SandboxUnavailable` naming the fix; it
never falls back to running the code without isolation.
"""

from __future__ import annotations

import functools
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

from atroposlib.sandbox.command import PRLIMIT, bwrap_argv
from atroposlib.sandbox.config import SandboxConfig
from atroposlib.sandbox.errors import SandboxUnavailable

__all__ = ["check_bwrap", "drop_privileges", "resolve_python"]

INSTALL_FIX = (
    "install bubblewrap: `apt-get install bubblewrap` (Debian/Ubuntu), `dnf install bubblewrap` "
    "(Fedora), or `make sandbox` in the atroposlib checkout"
)
USERNS_FIX = (
    "allow unprivileged user namespaces: `sysctl -w kernel.unprivileged_userns_clone=1` (older "
    "Debian), `sysctl -w user.max_user_namespaces=15000`, on Ubuntu 24.04+ "
    "`sysctl -w kernel.apparmor_restrict_unprivileged_userns=0`; inside Docker run the "
    "container with `--security-opt seccomp=unconfined --security-opt apparmor=unconfined`"
)
_PROBE_TIMEOUT_S = 30.0


SETPRIV = "/usr/bin/setpriv"
"""util-linux's ``setpriv``: how root starts bubblewrap as an unprivileged user (an argv
prefix rather than ``subprocess``'s ``user=``, which uvloop's subprocesses do not take)."""


def drop_privileges(config: SandboxConfig) -> List[str]:
    """The argv prefix that starts bubblewrap as ``config.uid`` when we are root (else none).

    Root's processes are exempt from the process limit, and root's uid would own the
    sandbox's user namespace, so root never runs one itself.
    """
    if os.geteuid() != 0:
        return []
    uid = str(config.uid)
    return [SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]


@functools.lru_cache(maxsize=8)
def _probe(bwrap: str, uid: int, as_root: bool) -> Tuple[bool, str]:
    config = SandboxConfig(uid=uid)
    argv = bwrap_argv(bwrap, config, ["/usr/bin/true"], limits=False)
    prefix = drop_privileges(config) if as_root else []
    try:
        done = subprocess.run(
            [*prefix, *argv], capture_output=True, timeout=_PROBE_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)
    return done.returncode == 0, done.stderr.decode(errors="replace").strip()


def check_bwrap(config: SandboxConfig) -> str:
    """The bubblewrap executable, once a trial sandbox ran ``/usr/bin/true``.

    Raises:
        SandboxUnavailable: bubblewrap or ``prlimit`` is missing, or the kernel refused the
            namespaces (the message says which and the fix).
    """
    bwrap = shutil.which(config.bwrap)
    if bwrap is None:
        raise SandboxUnavailable(
            f"the code sandbox needs bubblewrap, and {config.bwrap!r} was not found on PATH: "
            f"{INSTALL_FIX}"
        )
    for tool in (PRLIMIT, SETPRIV) if os.geteuid() == 0 else (PRLIMIT,):
        if not os.access(tool, os.X_OK):
            raise SandboxUnavailable(
                f"the code sandbox needs {tool}, which is missing: install util-linux "
                "(`apt-get install util-linux`)"
            )
    ok, said = _probe(bwrap, config.uid, os.geteuid() == 0)
    if not ok:
        raise SandboxUnavailable(
            f"bubblewrap cannot create a sandbox here (it said: {said or 'nothing'}); {USERNS_FIX}"
        )
    return bwrap


def _readable_by_others(path: Path) -> bool:
    """Whether a user who owns none of ``path``'s directories can run it."""
    try:
        for parent in [*reversed(path.parents), path]:
            mode = parent.stat().st_mode
            need = stat.S_IXOTH if parent != path else stat.S_IROTH | stat.S_IXOTH
            if mode & need != need:
                return False
    except OSError:
        return False
    return True


def resolve_python(config: SandboxConfig) -> Tuple[str, List[str]]:
    """``(interpreter, extra read-only mounts)`` for :meth:`Sandbox.run_python`.

    This process's base interpreter (not a virtual environment's: its packages stay out
    unless mounted with ``ro_paths``) when the sandbox user can run it, else
    ``/usr/bin/python3``.

    Raises:
        SandboxUnavailable: no interpreter the sandbox can run.
    """
    if config.python:
        return config.python, []
    base = Path(os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable))
    prefix = Path(sys.base_prefix).resolve()
    if base.is_file() and (os.geteuid() != 0 or _readable_by_others(base)):
        inside_usr = base.is_relative_to("/usr") and prefix.is_relative_to("/usr")
        return str(base), [] if inside_usr else [str(prefix)]
    if os.access("/usr/bin/python3", os.X_OK):
        return "/usr/bin/python3", []
    raise SandboxUnavailable(
        f"no Python the sandbox user can run ({base} is private to its owner and "
        "/usr/bin/python3 is missing): set SandboxConfig.python and mount it with ro_paths"
    )
