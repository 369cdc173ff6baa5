"""Run the OpenAI proxy over ManagedServer sessions as a real process, written once for the
tests that need one.

:func:`running_proxy` writes the proxy's ``servers.json`` and saves its tokenizer under a
directory of the test's, starts the proxy on a free port (another one when that port is
taken before the proxy binds it) and waits for ``/health``; the process is stopped when the
block ends.

Example::

    servers = [{"base_url": fake.base_url, "server_type": "vllm"}]
    with running_proxy(tmp_path, servers, "--max-sessions", "2",
                       tokenizer=tokenizer, model_name="fake", api_key=KEY) as proxy:
        httpx.post(f"{proxy.url}/sessions/create", json={}, headers=auth)
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from atroposlib.testing.launch import proxy_cmd
from atroposlib.testing.ports import start_on_free_port
from atroposlib.testing.processes import stop_process

__all__ = ["RunningProxy", "running_proxy"]


@dataclass(frozen=True)
class RunningProxy:
    """A started proxy process: its base URL (loopback), port, process and log file."""

    url: str
    port: int
    proc: subprocess.Popen
    log: Path


@contextlib.contextmanager
def running_proxy(
    tmp_path: str | Path,
    servers: Sequence[Mapping[str, Any]] | Mapping[str, Any] | None,
    *extra_flags: str,
    tokenizer: Any = None,
    model_name: str | None = None,
    api_key: str | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 120.0,
) -> Iterator[RunningProxy]:
    """Run the proxy for the duration of the block, healthy on entry.

    ``servers``: the upstream list (written as ``{"servers": [...]}``), a whole config
    mapping (for ``tool_parser`` or ``tokenizer`` keys), or None for no ``--config``.
    ``tokenizer``: an object with ``save_pretrained`` (saved to ``tmp_path/tok``), a path or
    name passed as it is, or None for no ``--tokenizer``. ``api_key`` reaches the proxy as
    ``ATROPOS_API_KEY``; ``env`` adds to its environment (which always has
    ``HF_HUB_OFFLINE=1``: a test never reaches the hub). ``extra_flags`` come last. The
    output goes to ``tmp_path/proxy.log``.
    """
    tmp = Path(tmp_path)
    args: list[str] = []
    if servers is not None:
        config = dict(servers) if isinstance(servers, Mapping) else {"servers": list(servers)}
        (tmp / "servers.json").write_text(json.dumps(config))
        args += ["--config", str(tmp / "servers.json")]
    if tokenizer is not None:
        if hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp / "tok")
            tokenizer = tmp / "tok"
        args += ["--tokenizer", str(tokenizer)]
    if model_name is not None:
        args += ["--model-name", model_name]
    args += extra_flags
    full_env = {"HF_HUB_OFFLINE": "1", **(env or {})}
    if api_key is not None:
        full_env["ATROPOS_API_KEY"] = api_key
    log = tmp / "proxy.log"
    try:
        proc, port = start_on_free_port(
            lambda port: proxy_cmd(port, *args), log_path=log, env=full_env, timeout=timeout
        )
    except TimeoutError:
        # An early exit carries the log in its error already; a hang does not.
        sys.stderr.write(log.read_text(errors="replace")[-4000:] if log.exists() else "")
        raise
    try:
        yield RunningProxy(f"http://127.0.0.1:{port}", port, proc, log)
    finally:
        stop_process(proc)
