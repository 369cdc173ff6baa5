"""Fixtures: one real ``atropos-serve-model`` process on loopback, and the same model
loaded in the test process for direct forward-pass comparisons."""

from __future__ import annotations

import sys

import pytest
import torch

from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import start_process, stop_process, wait_http
from tests.serving.support import KEY, ORIGIN, Served, serve_cmd


@pytest.fixture(scope="session")
def _servers(tiny_model_dir, tmp_path_factory):
    """Start both servers at once (startup is mostly imports; overlapping them halves the
    wall time on a busy machine): a plain one and one with ``--api-key``."""
    logs = tmp_path_factory.mktemp("serve")
    specs = {
        "plain": ["--served-model-name", "tiny", "alias"],
        "keyed": [
            "--api-key",
            KEY,
            "--swap-drain-timeout",
            "0.5",
            "--weights-root",
            str(tmp_path_factory.getbasetemp()),
            "--allow-client-chat-template",
            "--client-template-timeout",
            "1",
            "--cors-origin",
            ORIGIN,
        ],
    }
    started = {}
    try:
        for name, extra in specs.items():
            port = free_port()
            proc = start_process(
                serve_cmd(tiny_model_dir, port, *extra), log_path=logs / f"{name}.log"
            )
            started[name] = (proc, f"http://127.0.0.1:{port}", logs / f"{name}.log")
        yield started
    finally:
        for proc, _, _ in started.values():
            stop_process(proc)


def _ready(entry) -> str:
    proc, url, log = entry
    try:
        wait_http(f"{url}/health", timeout=180, proc=proc)
    except Exception:
        sys.stderr.write(log.read_text(errors="replace")[-4000:] if log.exists() else "")
        raise
    return url


@pytest.fixture(scope="session")
def served(_servers, tiny_model_dir) -> Served:
    return Served(_ready(_servers["plain"]), str(tiny_model_dir), "tiny")


@pytest.fixture(scope="session")
def keyed(_servers) -> str:
    """Root URL of the server started with ``--api-key KEY``."""
    return _ready(_servers["keyed"])


@pytest.fixture(scope="session")
def local_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)
