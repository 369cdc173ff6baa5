"""What one sandboxed run produced, and why it ended."""

from __future__ import annotations

import enum
import signal as signal_module
from dataclasses import dataclass

__all__ = ["EndReason", "SandboxResult"]


class EndReason(str, enum.Enum):
    """Why a run ended. The limits' reasons come from the signal the kernel sent, or from
    the program's last error line when the kernel only made a call fail (``MemoryError``,
    ``File too large``, a failed ``fork``)."""

    OK = "ok"
    """Exited with status 0."""
    ERROR = "error"
    """Exited with a non-zero status (an exception, ``sys.exit(1)``...)."""
    TIMEOUT = "timeout"
    """Still running at the wall-clock deadline: the whole process tree was killed."""
    CPU_LIMIT = "cpu_limit"
    """Used up its CPU time (SIGXCPU)."""
    MEMORY_LIMIT = "memory_limit"
    """An allocation failed at the address-space limit."""
    PROCESS_LIMIT = "process_limit"
    """A fork or thread failed at the process limit, and the program died of it."""
    FILE_SIZE_LIMIT = "file_size_limit"
    """A write failed at the file-size limit or on a full /tmp."""
    OUTPUT_LIMIT = "output_limit"
    """Wrote more than the output bound to stdout or stderr: the tree was killed."""
    SIGNAL = "signal"
    """Killed by another signal (a crash, or a program that killed itself)."""
    SANDBOX_ERROR = "sandbox_error"
    """bubblewrap failed before the program started (its message is in ``stderr``)."""


_MESSAGES = {
    EndReason.OK: "exited with status 0",
    EndReason.TIMEOUT: "still running at the {timeout:g} s deadline: process tree killed",
    EndReason.CPU_LIMIT: "CPU time limit reached (SIGXCPU)",
    EndReason.MEMORY_LIMIT: "memory limit reached (allocation failed)",
    EndReason.PROCESS_LIMIT: "process limit reached (fork or thread failed)",
    EndReason.FILE_SIZE_LIMIT: "file size limit reached or /tmp full",
    EndReason.OUTPUT_LIMIT: "output limit of {max_output} bytes exceeded: process tree killed",
    EndReason.SANDBOX_ERROR: "the sandbox failed to start the program",
}


@dataclass(frozen=True)
class SandboxResult:
    """One run: its output (decoded as UTF-8, invalid bytes replaced), how it ended and why.

    ``exit_code`` is the program's status (None when it was killed or died of a signal);
    ``signal`` the number of the signal that ended it, if any. ``*_truncated`` say that the
    stream was cut at the output bound.
    """

    stdout: str
    stderr: str
    reason: EndReason
    exit_code: int | None
    signal: int | None
    duration_s: float
    timeout_s: float
    max_output_bytes: int
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @property
    def ok(self) -> bool:
        """True when the program exited with status 0 within every bound."""
        return self.reason is EndReason.OK

    @property
    def message(self) -> str:
        """One line saying how the run ended, e.g. ``"exited with status 1"``."""
        if self.reason is EndReason.ERROR:
            return f"exited with status {self.exit_code}"
        if self.reason is EndReason.SIGNAL:
            return f"killed by {_signal_name(self.signal)}"
        return _MESSAGES[self.reason].format(
            timeout=self.timeout_s, max_output=self.max_output_bytes
        )


def _signal_name(number: int | None) -> str:
    if number is None:
        return "a signal"
    try:
        return signal_module.Signals(number).name
    except ValueError:
        return f"signal {number}"
