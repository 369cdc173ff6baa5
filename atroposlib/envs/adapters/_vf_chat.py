"""The ``atropos-chat`` harness of :mod:`atroposlib.envs.adapters.verifiers_v1`.

verifiers 0.4 runs every harness program as a PEP 723 script through ``uv``, which
installs the program's dependencies from PyPI the first time (and ``uv`` itself if it is
missing). This harness runs verifiers' own tool-less chat program, the one its ``null``
harness runs, with this process's interpreter instead: verifiers' install already
brings everything that program imports (openai, mcp, httpx), so a rollout needs no
network. It runs only in the local ``subprocess`` runtime (the interpreter is this
machine's).

verifiers resolves a harness id as a top-level module (or a module of
``verifiers.v1.harnesses``), so :func:`register` makes this module importable as
``atropos_chat`` (harness id ``atropos-chat``). Importing this module imports verifiers.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import Any

from verifiers.v1.harnesses.null import NullHarness
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
from verifiers.v1.runtimes.subprocess import SubprocessRuntime

from atroposlib.envs.adapters._private_dir import PrivateDirError, check_private, private_dir

__all__ = ["AtroposChatHarness"]

HARNESS_ID = "atropos-chat"
MODULE_ALIAS = "atropos_chat"


def register() -> str:
    """Make this harness loadable by verifiers under :data:`HARNESS_ID`; returns the id."""
    sys.modules.setdefault(MODULE_ALIAS, sys.modules[__name__])
    return HARNESS_ID


_PROGRAM_DIR: Path | None = None


def _program_dir() -> Path:
    """This process's directory for the program, readable by nobody else.

    A name in the shared temp dir can be taken or swapped by another user between a check
    and the run; a fresh ``mkdtemp`` directory under one only this user can write
    (:func:`~atroposlib.envs.adapters._private_dir.private_dir`, checked by file
    descriptor) cannot.
    """
    global _PROGRAM_DIR
    try:
        if _PROGRAM_DIR is None:
            _PROGRAM_DIR = private_dir(f"{HARNESS_ID}-")
        else:
            check_private(_PROGRAM_DIR)  # again before each use: it must still be ours alone
    except PrivateDirError as e:
        raise RuntimeError(f"the {HARNESS_ID} harness needs a private directory: {e}") from e
    return _PROGRAM_DIR


def _program_path() -> str:
    """The chat program written once per content (a content-addressed file, like uv's)."""
    data = CHAT_PROGRAM_SOURCE.encode()
    path = _program_dir() / f"{hashlib.sha256(data).hexdigest()}.py"
    if not path.exists() or path.read_bytes() != data:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)  # atomic: concurrent rollouts never read half a file
    return str(path)


class _LocalInterpreter:
    """A view of a runtime whose ``prepare_uv_script`` runs the script with this
    interpreter (no uv); everything else is the runtime's own."""

    def __init__(self, runtime: Any):
        self._runtime = runtime

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)

    async def prepare_uv_script(self, script: Any, env: Any = None, **_: Any) -> list[str]:
        if script != CHAT_PROGRAM_SOURCE:
            raise RuntimeError("atropos-chat runs only verifiers' chat program")
        return [sys.executable, _program_path()]


class AtroposChatHarness(NullHarness):
    """verifiers' ``null`` chat loop, run by this interpreter (offline)."""

    async def setup(self, runtime: Any) -> None:
        if not isinstance(runtime, SubprocessRuntime):
            raise RuntimeError(
                f"the {HARNESS_ID} harness runs on this machine only: use the subprocess "
                f"runtime, not {type(runtime).__name__}"
            )
        _program_path()

    async def launch(self, ctx: Any, trace: Any, runtime: Any, *args: Any, **kwargs: Any) -> Any:
        """verifiers' ``null`` launch, with ``runtime`` seen through :class:`_LocalInterpreter`."""
        return await super().launch(ctx, trace, _LocalInterpreter(runtime), *args, **kwargs)
