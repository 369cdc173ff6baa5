"""Repository-wide test configuration: offline, no W&B network, shared fixtures."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Dict, Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.pop("ATROPOS_API_KEY", None)
os.environ.pop("ATROPOS_PROXY_URL", None)

from atroposlib.testing.ports import free_port  # noqa: E402

# Per-file times (.cache/test-times.json) and the default tier's budget (make test's --budget).
pytest_plugins = ["tests._timing", "pytester"]


@pytest.fixture
def port() -> int:
    """A free TCP port on 127.0.0.1."""
    return free_port()


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """Directory of the offline tiny causal LM + tokenizer (built once, cached on disk)."""
    from atroposlib.tiny_model import ensure_tiny_model

    return Path(ensure_tiny_model())


@pytest.fixture(scope="session")
def serve_model(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Dict[str, str]]:
    """``{"base_url", "model"}`` of one running ``atropos-serve-model`` on the tiny model
    (seed 0), shared by every test of the session that asks for it."""
    from atroposlib.testing.launch import serve_model_cmd
    from atroposlib.testing.processes import running_process

    port = free_port()
    log = tmp_path_factory.mktemp("serve_model") / "serve.log"
    cmd = serve_model_cmd(tiny_model_dir, port, "--seed", "0")
    with running_process(
        cmd, health_url=f"http://127.0.0.1:{port}/health", timeout=180, log_path=log
    ):
        yield {"base_url": f"http://127.0.0.1:{port}/v1", "model": str(tiny_model_dir)}


# The second tier (make test-tier2): full stacks, floods, real vLLM, multi-node rehearsals.
# `make test` runs `-m "not tier2"` under its time budget. These markers put a test there too.
TIER2_IMPLIED_BY = ("slow", "vllm", "multinode", "slurm")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if any(item.get_closest_marker(name) for name in TIER2_IMPLIED_BY):
            item.add_marker(pytest.mark.tier2)
