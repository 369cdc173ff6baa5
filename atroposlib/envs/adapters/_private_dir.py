"""A fresh directory only this user can reach, for a program this interpreter will run.

A name chosen in a directory others can write (the shared temp dir, or one a ``TMPDIR``
points at) can be taken, or swapped between our check and the run. So the directory is made
by ``mkdtemp`` (a new random name, mode 0700) inside a base directory that only this user
can write: ``$XDG_RUNTIME_DIR`` when it qualifies, else ``~/.cache/atropos``. The base is
checked through a file descriptor opened without following links (owner, not group- or
world-writable, a directory), so what is checked is what is used; every directory above it
must be root's or this user's and not writable by others (sticky ones excepted: there only
an entry's owner may move it). The new directory is checked again the same way.
"""

from __future__ import annotations

import atexit
import os
import shutil
import stat
import tempfile
from pathlib import Path

__all__ = ["PrivateDirError", "check_private", "default_base", "private_dir"]


class PrivateDirError(RuntimeError):
    """A directory on the way is not one only this user can write (the message says which)."""


def _problem(info: os.stat_result, uid: int) -> str | None:
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid != uid:
        return f"is owned by uid {info.st_uid}, not this user ({uid})"
    if info.st_mode & 0o022:
        return f"is writable by others (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def _open_checked(path: Path, uid: int) -> int:
    """An fd of ``path`` (no link followed) whose fstat shows a directory of ``uid`` that no
    one else can write; :class:`PrivateDirError` otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:  # ENOTDIR or ELOOP for a link, ENOTDIR for a file, EACCES ...
        if os.path.islink(path):
            what = "is a symbolic link"
        elif isinstance(e, NotADirectoryError):
            what = "is not a directory (a file is in the way); remove it and retry"
        else:
            what = f"cannot be opened ({e.strerror})"
        raise PrivateDirError(f"{path} {what}; it must be a directory of this user's") from None
    problem = _problem(os.fstat(fd), uid)
    if problem is not None:
        os.close(fd)
        raise PrivateDirError(f"{path} {problem}; it must be a directory only this user can write")
    return fd


def _check_ancestors(path: Path, uid: int) -> None:
    for parent in path.parents:
        info = parent.stat()
        if info.st_uid not in (0, uid):
            raise PrivateDirError(f"{parent} (above {path}) is owned by uid {info.st_uid}")
        if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
            raise PrivateDirError(
                f"{parent} (above {path}) is writable by others "
                f"(mode {stat.S_IMODE(info.st_mode):04o}) and not sticky"
            )


def default_base() -> Path:
    """``$XDG_RUNTIME_DIR`` (a per-user 0700 directory) when set, else ``~/.cache/atropos``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime):
        return Path(runtime)
    return Path.home() / ".cache" / "atropos"


def private_dir(prefix: str, base: Path | None = None) -> Path:
    """A new directory (``mkdtemp``, mode 0700) under ``base`` (default :func:`default_base`),
    removed when the interpreter exits; :class:`PrivateDirError` when ``base`` or the new
    directory is not one only this user can write."""
    uid = os.getuid()
    base = Path(base) if base is not None else default_base()
    if not base.exists() and not base.is_symlink():
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_ancestors(base, uid)
    os.close(_open_checked(base, uid))
    made = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    atexit.register(shutil.rmtree, made, ignore_errors=True)
    check_private(made)  # made by us a moment ago: checked all the same
    return made


def check_private(path: Path) -> None:
    """Check, through a file descriptor opened without following links, that ``path`` is a
    directory of this user's that nobody else can read or write (mode 0700);
    :class:`PrivateDirError` otherwise. Cheap enough to repeat before each use."""
    fd = _open_checked(Path(path), os.getuid())
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
    if mode & 0o077:
        raise PrivateDirError(f"{path} has mode {mode:04o}; it must be mode 0700")
