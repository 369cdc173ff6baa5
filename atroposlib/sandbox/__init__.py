"""Run untrusted code in a bubblewrap sandbox: no network, a read-only host, a private /tmp,
bounded CPU, memory, processes, files and output, and a deadline that kills the whole tree.

Example::

    from atroposlib.sandbox import Sandbox, SandboxConfig

    sandbox = Sandbox(SandboxConfig(timeout_s=5))   # SandboxUnavailable (with the fix) if not here
    result = await sandbox.run_python("print(int(input()) ** 2)", stdin="7")
    assert result.ok and result.stdout == "49\\n"

See docs/sandbox.md.
"""

from atroposlib.sandbox.config import SandboxConfig
from atroposlib.sandbox.errors import SandboxUnavailable
from atroposlib.sandbox.result import EndReason, SandboxResult
from atroposlib.sandbox.runner import Sandbox

__all__ = ["EndReason", "Sandbox", "SandboxConfig", "SandboxResult", "SandboxUnavailable"]
