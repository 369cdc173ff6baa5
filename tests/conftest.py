"""Repository-wide test configuration: offline, no W&B network, shared fixtures."""

from __future__ import annotations

import os
import sys
from pathlib import Path

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


# The second tier (make test-tier2): full stacks, floods, real vLLM, multi-node rehearsals.
# `make test` runs `-m "not tier2"` under its time budget. These markers put a test there too.
TIER2_IMPLIED_BY = ("slow", "vllm", "multinode")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if any(item.get_closest_marker(name) for name in TIER2_IMPLIED_BY):
            item.add_marker(pytest.mark.tier2)
