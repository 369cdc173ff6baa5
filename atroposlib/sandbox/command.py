"""The bubblewrap command line of one run, as a pure function of its inputs.

What the sandbox sees of the host: ``/usr`` (and the top-level links into it) read-only,
the paths the caller adds read-only, a fresh ``/proc`` and a minimal read-only ``/dev``, and
a private, size-bounded ``/tmp`` (the working directory) and ``/dev/shm``, the only
writable places.
Every namespace is new (no network but a loopback that is down, its own pids, no way back
to the host's user), capabilities are dropped, the environment is cleared, and the program
cannot create further user namespaces. The resource limits are set inside the sandbox, by
``prlimit`` right before the program: there ``RLIMIT_NPROC`` counts only the sandbox's own
processes (its user namespace has its own count), so one fork bomb cannot starve the
sandboxes beside it.
"""

from __future__ import annotations

import os
from typing import Iterable, List, Sequence, Tuple

from atroposlib.sandbox.config import SandboxConfig

__all__ = ["PRLIMIT", "SANDBOX_ENV", "bwrap_argv", "prlimit_argv"]

PRLIMIT = "/usr/bin/prlimit"
"""util-linux's ``prlimit``, run inside the sandbox to set the limits on the program."""

SANDBOX_ENV: Tuple[Tuple[str, str], ...] = (
    ("PATH", "/usr/local/bin:/usr/bin:/bin"),
    ("HOME", "/tmp"),
    ("TMPDIR", "/tmp"),
    ("LANG", "C.UTF-8"),
    ("PYTHONDONTWRITEBYTECODE", "1"),
    ("PYTHONIOENCODING", "utf-8"),
    # One thread per numeric library: threads count against the process limit.
    ("OMP_NUM_THREADS", "1"),
    ("OPENBLAS_NUM_THREADS", "1"),
    ("MKL_NUM_THREADS", "1"),
)
"""The whole environment of a sandboxed program (the host's is never passed on)."""

_TOP_LEVEL = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_FILES = ("/etc/ld.so.cache", "/etc/alternatives")


def prlimit_argv(config: SandboxConfig) -> List[str]:
    """``prlimit`` with every limit of ``config``, ready for the program's argv."""
    cpu = config.cpu_limit()
    return [
        PRLIMIT,
        f"--cpu={cpu}:{cpu + 1}",
        f"--as={config.memory_mb << 20}",
        f"--fsize={config.max_file_mb << 20}",
        f"--nproc={config.max_processes}",
        f"--nofile={config.max_open_files}",
        "--core=0",
        "--",
    ]


def _host_root_args() -> List[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for path in _TOP_LEVEL:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in _ETC_FILES:
        args += ["--ro-bind-try", path, path]
    return args


def bwrap_argv(
    bwrap: str,
    config: SandboxConfig,
    argv: Sequence[str],
    *,
    files: Iterable[Tuple[int, str]] = (),
    ro_paths: Iterable[str] = (),
    info_fd: int | None = None,
    limits: bool = True,
) -> List[str]:
    """The full command: ``bwrap`` with the isolation above, then the program ``argv``.

    ``files`` are ``(fd, name)`` pairs: each fd's content becomes ``/tmp/<name>``.
    ``info_fd`` gets bubblewrap's JSON with the program's host pid (for killing the tree).
    ``limits=False`` leaves out ``prlimit`` (the start-up probe only).
    """
    args = [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--hostname",
        "sandbox",
        *_host_root_args(),
    ]
    tmp_size = str(config.tmp_mb << 20)
    # /dev is a tmpfs of its own: read-only but for a /dev/shm as bounded as /tmp.
    args += ["--proc", "/proc", "--dev", "/dev", "--size", tmp_size, "--tmpfs", "/dev/shm"]
    args += ["--remount-ro", "/dev", "--size", tmp_size, "--tmpfs", "/tmp"]
    for fd, name in files:
        args += ["--file", str(fd), f"/tmp/{name}"]
    for path in ro_paths:  # after the tmpfs, so that a path under /tmp is not hidden by it
        args += ["--ro-bind", path, path]
    args += ["--chdir", "/tmp", "--clearenv"]
    for key, value in SANDBOX_ENV:
        args += ["--setenv", key, value]
    args += ["--remount-ro", "/"]
    if info_fd is not None:
        args += ["--info-fd", str(info_fd)]
    args.append("--")
    if limits:
        args += prlimit_argv(config)
    args += list(argv)
    return args
