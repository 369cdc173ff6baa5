"""Fixtures that tests/cli and tests/frontend share (their conftests import them): a local
tokenizer, rollouts files and a keyed run-api."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest

from atroposlib.testing.tokenizers import bytes_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer directory loadable offline by AutoTokenizer."""
    out_dir = tmp_path_factory.mktemp("byte-tokenizer")
    bytes_tokenizer().save_pretrained(str(out_dir))
    return out_dir


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="session")
def make_group(tokenizer: Any) -> Callable[..., dict[str, Any]]:
    """Build a ScoredDataGroup like ``process`` writes: shared prompt, one completion per score."""

    def make(
        prompt: str, completions: list[str], scores: list[float], **extra: Any
    ) -> dict[str, Any]:
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        group: dict[str, Any] = {
            "tokens": [],
            "masks": [],
            "scores": list(scores),
            "messages": [],
            "inference_logprobs": [],
        }
        for k, completion in enumerate(completions):
            comp_ids = tokenizer.encode(completion, add_special_tokens=False)
            group["tokens"].append(prompt_ids + comp_ids)
            group["masks"].append([-100] * len(prompt_ids) + comp_ids)
            group["inference_logprobs"].append(
                [1.0] * len(prompt_ids) + [-0.5 - 0.01 * k] * len(comp_ids)
            )
            group["messages"].append(
                [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": prompt},
                    {"role": "assistant", "content": completion},
                ]
            )
        group.update(extra)
        return group

    return make


@pytest.fixture(scope="session")
def write_jsonl() -> Callable[[Path, list], Path]:
    """Write dicts (or raw strings) as jsonl lines."""

    def write(path: Path, rows: list) -> Path:
        path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
        return path

    return write


API_KEY = "test-secret-key"


@pytest.fixture(scope="session")
def api_key() -> str:
    """The key the tools' ``run-api`` requires."""
    return API_KEY


@pytest.fixture(scope="session")
def keyed_api(tmp_path_factory: pytest.TempPathFactory):
    """One real ``run-api`` for the tools' tests, requiring ``Authorization: Bearer API_KEY``."""
    pytest.importorskip("atroposlib.cli.run_api")
    from atroposlib.testing.api import running_api

    log = tmp_path_factory.mktemp("api") / "api.log"
    with running_api(log, "--api-key", API_KEY) as api:
        yield api.url
