"""Command lines of the servers that tests and benchmarks start: run-api, serve-model, the
OpenAI proxy and the fake inference server, each written once.

Each runs under the test's own interpreter (``python -m ...``) so a source checkout is
exercised without installing its console scripts, and binds loopback only.

Example::

    port = free_port()
    with running_process(serve_model_cmd(model_dir, port, "--seed", "0"),
                         health_url=f"http://127.0.0.1:{port}/health", timeout=180):
        ...
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["fake_server_cmd", "proxy_cmd", "run_api_cmd", "serve_model_cmd"]


def run_api_cmd(port: int, *extra: str, python: str | None = None) -> list[str]:
    """``run-api`` on ``127.0.0.1:port``, followed by ``extra`` flags."""
    return [
        python or sys.executable,
        "-m",
        "atroposlib.cli.run_api",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
    ]


def serve_model_cmd(
    model_dir: str | Path, port: int, *extra: str, python: str | None = None
) -> list[str]:
    """``atropos-serve-model model_dir`` on ``127.0.0.1:port``, followed by ``extra`` flags."""
    return [
        python or sys.executable,
        "-m",
        "atroposlib.cli.serve_model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
    ]


def fake_server_cmd(port: int, *extra: str, python: str | None = None) -> list[str]:
    """The fake inference server (:mod:`atroposlib.testing.fake_server`) on ``port``."""
    return [
        python or sys.executable,
        "-m",
        "atroposlib.testing.fake_server",
        "--port",
        str(port),
        *extra,
    ]


def proxy_cmd(port: int, *extra: str, python: str | None = None) -> list[str]:
    """The OpenAI proxy over ManagedServer sessions on ``port`` (its own default host), then
    ``extra`` flags (``--config``, ``--tokenizer``, bounds)."""
    return [
        python or sys.executable,
        "-m",
        "atroposlib.envs.server_handling.managed_server_proxy",
        "--port",
        str(port),
        *extra,
    ]
