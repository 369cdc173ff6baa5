"""A Qwen chat template that keeps ``<think>`` blocks of earlier assistant turns.

Qwen3's stock template strips reasoning from all but the last assistant turn, so a
multi-turn chat re-rendered for training no longer matches the tokens the model
generated. This template renders every message verbatim (ChatML, with tool calls and
tool responses), which keeps prompts prefix-stable across turns.

Example::

    tok = load_qwen_fixed_tokenizer("Qwen/Qwen3-1.7B")
"""

from __future__ import annotations

from importlib import resources
from typing import Any


def qwen_fixed_chat_template() -> str:
    """The jinja source of the fixed template."""
    return (resources.files(__package__) / "qwen_fixed_chat_template.jinja").read_text(
        encoding="utf-8"
    )


def apply_qwen_fixed_template(tokenizer: Any) -> Any:
    """Install the fixed template on ``tokenizer`` (in place) and return it."""
    tokenizer.chat_template = qwen_fixed_chat_template()
    return tokenizer


def load_qwen_fixed_tokenizer(name_or_path: str, **kwargs: Any) -> Any:
    """``AutoTokenizer.from_pretrained(name_or_path)`` with the fixed template installed."""
    from transformers import AutoTokenizer

    return apply_qwen_fixed_template(AutoTokenizer.from_pretrained(name_or_path, **kwargs))


__all__ = ["apply_qwen_fixed_template", "load_qwen_fixed_tokenizer", "qwen_fixed_chat_template"]
