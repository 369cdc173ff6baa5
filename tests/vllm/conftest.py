"""Session fixtures of the tests against vLLM's own server (``.venv-vllm``, started once).

- ``vllm_python`` (str): the interpreter of the vLLM venv. Without one the tests skip with the
  reason, except under CI (``CI`` set), where they fail and name the command that builds it:
  CI must never pass without running them.
- ``vllm_model_dir`` (Path): the offline tiny model with head_dim 32 (what vLLM's CPU attention
  serves), built once per session.
- ``vllm_server`` (:class:`atroposlib.testing.vllm_server.RunningVLLM`): vLLM's OpenAI server on
  that model, started once for the whole session with ``DEFAULT_ARGS`` (fp32, LoRA, the
  scale-out routes) and ``VLLM_ENV`` (dev-mode RL routes, runtime LoRA). ``.base_url`` is
  ``http://127.0.0.1:PORT/v1``, ``.url`` the root, ``.model_name`` the served name,
  ``.model_dir``, ``.process``, ``.log_path``. Tests that change the served weights or version
  put them back before they end (the server is shared).

Every test here carries the ``vllm`` marker (``-m "not vllm"`` leaves them out).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

from atroposlib.testing.vllm_server import (
    RunningVLLM,
    build_vllm_tiny_model,
    find_vllm_python,
    start_vllm_server,
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    for item in items:
        if here in item.path.resolve().parents:
            item.add_marker(pytest.mark.vllm)
            # The first test also waits for the session's vLLM to start (minutes on 2 cores).
            item.add_marker(pytest.mark.timeout(900))


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The vLLM venv's interpreter; skips (fails under CI) without it."""
    python, problem = find_vllm_python()
    if python is None:
        if os.environ.get("CI"):
            pytest.fail(problem)
        pytest.skip(problem)
    return python


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model (seed 0) shaped for vLLM: 2 attention heads of 32, 1 KV head."""
    return build_vllm_tiny_model(tmp_path_factory.mktemp("vllm-model") / "tiny")


@pytest.fixture(scope="session")
def vllm_server(
    vllm_python: str, vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningVLLM]:
    """vLLM's OpenAI server on the tiny model, one for the session."""
    log = tmp_path_factory.mktemp("vllm-server") / "vllm.log"
    server = start_vllm_server(vllm_python, vllm_model_dir, log)
    try:
        yield server
    finally:
        server.stop()
