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
from typing import Any, Dict, List, Union


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


class QwenFixedTokenizer:
    """A Hugging Face tokenizer whose chat template is the fixed one, as a drop-in object.

    Every attribute and method of the wrapped tokenizer is available (``encode``,
    ``decode``, ``eos_token_id``, ...); ``apply_chat_template`` always renders with the
    fixed template.

    Example::

        tok = QwenFixedTokenizer("Qwen/Qwen3-1.7B")
        ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    """

    @classmethod
    def _load_chat_template(cls) -> str:
        """The jinja source of the fixed template."""
        return qwen_fixed_chat_template()

    def __init__(self, model_name_or_path: str, **kwargs: Any) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_name_or_path, **kwargs)
        self.chat_template = self._load_chat_template()
        self.tokenizer.chat_template = self.chat_template

    def apply_chat_template(
        self,
        conversation: List[Dict[str, str]],
        tools: List[Dict[str, Any]] | None = None,
        tokenize: bool = True,
        padding: bool = False,
        truncation: bool = False,
        max_length: int | None = None,
        return_tensors: Union[str, bool] | None = None,
        return_dict: bool = False,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> Any:
        """The wrapped tokenizer's ``apply_chat_template`` with the fixed template."""
        kwargs.pop("chat_template", None)
        return self.tokenizer.apply_chat_template(
            conversation,
            tools=tools,
            tokenize=tokenize,
            padding=padding,
            truncation=truncation,
            max_length=max_length,
            return_tensors=return_tensors,
            return_dict=return_dict,
            add_generation_prompt=add_generation_prompt,
            chat_template=self.chat_template,
            **kwargs,
        )

    def __getattr__(self, name: str) -> Any:
        # Only reached for names this wrapper lacks: the wrapped tokenizer answers.
        if name == "tokenizer":
            raise AttributeError(name)
        return getattr(self.tokenizer, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.tokenizer(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.tokenizer)


__all__ = [
    "QwenFixedTokenizer",
    "apply_qwen_fixed_template",
    "load_qwen_fixed_tokenizer",
    "qwen_fixed_chat_template",
]
