"""Shared fixture of the environment tests: one real ``atropos-serve-model`` process with
the offline tiny model (helpers live in ``env_helpers.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterator

import pytest

from atroposlib.testing.launch import serve_model_cmd
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import running_process


@pytest.fixture(scope="session")
def serve_model(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Dict[str, str]]:
    """``{"base_url", "model"}`` of a running ``atropos-serve-model`` on the tiny model."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve_model") / "serve.log"
    cmd = serve_model_cmd(tiny_model_dir, port, "--seed", "0")
    with running_process(
        cmd, health_url=f"http://127.0.0.1:{port}/health", timeout=180, log_path=log
    ):
        yield {"base_url": f"http://127.0.0.1:{port}/v1", "model": str(tiny_model_dir)}
