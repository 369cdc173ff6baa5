"""Fixtures of the multi-node tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    """The tiny model's tokenizer (for the groups a feeder posts)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))
