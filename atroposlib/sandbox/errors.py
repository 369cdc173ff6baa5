"""The one error the sandbox raises at start: it cannot isolate code here, and how to fix that."""

from __future__ import annotations

__all__ = ["SandboxUnavailable"]


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing, or the kernel refuses it the namespaces it needs.

    Raised when a :class:`~atroposlib.sandbox.runner.Sandbox` is created, never in the middle
    of a run, and never answered by running the code unsandboxed. The message names the fix.
    """
