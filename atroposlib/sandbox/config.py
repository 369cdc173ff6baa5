"""The limits of one sandboxed run: each field is a bound the kernel or the runner enforces.

Example::

    SandboxConfig(timeout_s=5, memory_mb=256, max_processes=16)
"""

from __future__ import annotations

import math
from typing import List

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["NOBODY_UID", "SandboxConfig"]

NOBODY_UID = 65534
"""The uid (and gid) a sandbox started by root runs as: ``nobody`` on Debian."""


class SandboxConfig(BaseModel):
    """Bounds and setup of a bubblewrap sandbox (docs/sandbox.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    timeout_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="Wall-clock deadline of one run in seconds; at it the whole process tree is "
        "killed and the run ends with reason 'timeout'.",
    )
    cpu_seconds: float | None = Field(
        None,
        gt=0,
        description="CPU time of the program (RLIMIT_CPU, per process; reason 'cpu_limit'). "
        "None: the timeout, rounded up.",
    )
    memory_mb: int = Field(
        512,
        ge=32,
        description="Address space of each process in MiB (RLIMIT_AS); an allocation beyond it "
        "fails (a Python MemoryError: reason 'memory_limit').",
    )
    max_processes: int = Field(
        32,
        ge=2,
        description="Processes and threads the sandbox may hold at once (RLIMIT_NPROC inside its "
        "own user namespace, so sandboxes do not share the count).",
    )
    max_file_mb: int = Field(
        16, ge=0, description="Largest file the program may write, in MiB (RLIMIT_FSIZE)."
    )
    tmp_mb: int = Field(
        64, ge=1, description="Size of the private writable /tmp (a tmpfs), in MiB."
    )
    max_open_files: int = Field(
        64, ge=8, description="Open file descriptors per process (RLIMIT_NOFILE)."
    )
    max_output_bytes: int = Field(
        1 << 20,
        ge=1,
        description="Bytes kept of stdout and of stderr each; the first byte beyond ends the "
        "run with reason 'output_limit'.",
    )
    max_input_bytes: int = Field(
        16 << 20, ge=0, description="Largest stdin accepted, in bytes (ValueError beyond)."
    )
    python: str | None = Field(
        None,
        description="Python interpreter run by run_python; None: this interpreter when the "
        "sandbox user can read it, else /usr/bin/python3.",
    )
    ro_paths: List[str] = Field(
        default_factory=list,
        description="Extra host paths mounted read-only at the same place (e.g. a virtual "
        "environment with numpy). /usr is always mounted; nothing else of the host is.",
    )
    uid: int = Field(
        NOBODY_UID,
        ge=1,
        description="Unprivileged uid and gid the sandbox runs as when started by root "
        "(others run it as themselves).",
    )
    bwrap: str = Field("bwrap", description="The bubblewrap executable (name or path).")

    def cpu_limit(self) -> int:
        """RLIMIT_CPU's soft limit in whole seconds (the hard one is a second above)."""
        return max(1, math.ceil(self.cpu_seconds if self.cpu_seconds else self.timeout_s))
