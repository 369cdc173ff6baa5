"""Fixtures for the utilities tests: a real byte-level BPE tokenizer with a ChatML template."""

from __future__ import annotations

import pytest

from atroposlib.testing.tokenizers import chatml_tokenizer


@pytest.fixture(scope="session")
def chat_tokenizer():
    """The tiny model's tokenizer when its kit is available, else a throwaway one."""
    try:
        from transformers import AutoTokenizer

        from atroposlib.tiny_model import ensure_tiny_model

        return AutoTokenizer.from_pretrained(ensure_tiny_model())
    except Exception:  # kit not available yet in this checkout: fall back, same shape
        return chatml_tokenizer()
