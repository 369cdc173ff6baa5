"""Fixtures: one real ``atropos-serve-model`` process on loopback, and the same model
loaded in the test process for direct forward-pass comparisons."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.procs import free_port, running_process
from tests.serve_model.support import Served, serve_cmd


@pytest.fixture(scope="session")
def served(tiny_model_dir, tmp_path_factory) -> Served:
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with running_process(serve_cmd(tiny_model_dir, port, "--served-model-name", "tiny", "alias"),
                         health_url=f"http://127.0.0.1:{port}/health", log_path=log,
                         timeout=120):
        yield Served(f"http://127.0.0.1:{port}", str(tiny_model_dir), "tiny")


@pytest.fixture(scope="session")
def local_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


