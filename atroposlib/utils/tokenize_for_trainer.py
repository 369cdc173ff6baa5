"""Turn a chat into trainer-ready ``tokens`` and ``masks``.

Masks use ``-100`` where no loss is taken (the prompt) and the token id where it is
(the completion). By default only the last assistant (or agent) turn is trained, even
when other messages (tool results) follow it; with ``train_on_all_assistant_turns``
every assistant/agent turn is.

Example::

    out = tokenize_for_trainer(tokenizer, [{"role": "user", "content": "hi"},
                                           {"role": "assistant", "content": "hello"}])
    assert len(out["tokens"]) == len(out["masks"])
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Sequence

UNMASKED_ROLES = ["assistant", "agent"]
"""Roles whose turns are unmasked when ``train_on_all_assistant_turns`` is set."""

MASK_ID = -100


def _as_token_list(encoded: Any) -> List[int]:
    """Normalise what ``apply_chat_template`` returns (list, dict or BatchEncoding) to ids."""
    if isinstance(encoded, Mapping) or hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    ids = list(encoded)
    if ids and isinstance(ids[0], (list, tuple)):  # a batch of one
        ids = list(ids[0])
    return [int(t) for t in ids]


def chat_token_ids(
    tokenizer: Any,
    chat: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = False,
    **template_kwargs: Any,
) -> List[int]:
    """Token ids of ``chat`` rendered with the tokenizer's chat template.

    Works with transformers 4 (returns a list) and 5 (returns a dict unless
    ``return_dict=False``). An empty chat is an empty list.
    """
    if len(chat) == 0 and not add_generation_prompt:
        return []
    try:
        encoded = tokenizer.apply_chat_template(
            list(chat),
            tokenize=True,
            add_generation_prompt=add_generation_prompt,
            return_dict=False,
            **template_kwargs,
        )
    except TypeError:  # an older or duck-typed tokenizer without return_dict
        encoded = tokenizer.apply_chat_template(
            list(chat),
            tokenize=True,
            add_generation_prompt=add_generation_prompt,
            **template_kwargs,
        )
    return _as_token_list(encoded)


def _validate_chat(chat: Sequence[Mapping[str, Any]]) -> None:
    if not chat:
        raise ValueError("tokenize_for_trainer: chat is empty")
    for i, message in enumerate(chat):
        if not isinstance(message, Mapping):
            raise ValueError(f"tokenize_for_trainer: chat[{i}] is not a dict")
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"tokenize_for_trainer: chat[{i}] has no '{key}'")


def tokenize_for_trainer(
    tokenizer: Any,
    chat: List[Dict[str, Any]],
    include_messages: bool = False,
    train_on_all_assistant_turns: bool = False,
    finish_reason: str = "",
) -> Dict[str, Any]:
    """Tokenize ``chat`` and build the loss mask.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        chat: the messages, the completion last.
        include_messages: also return the messages under ``"messages"``.
        train_on_all_assistant_turns: unmask every turn whose role is in
            ``UNMASKED_ROLES`` instead of only the last such turn (with none, nothing
            is unmasked).
        finish_reason: when ``"length"`` and the sequence ends with EOS, the EOS is
            dropped (the model did not actually stop).

    Returns:
        ``{"tokens": [...], "masks": [...]}`` (+ ``"messages"``), equal lengths.

    Raises:
        ValueError: on an empty chat or a message without role/content.
    """
    _validate_chat(chat)
    tokens = chat_token_ids(tokenizer, chat)
    trained = [i for i, message in enumerate(chat) if message["role"] in UNMASKED_ROLES]
    if not train_on_all_assistant_turns:
        trained = trained[-1:]
    masks = [MASK_ID] * len(tokens)
    for i in trained:
        start = len(chat_token_ids(tokenizer, chat[:i], add_generation_prompt=True))
        # The last message of the chat owns everything to the end (what the template adds).
        end = len(tokens) if i == len(chat) - 1 else len(chat_token_ids(tokenizer, chat[: i + 1]))
        for j in range(start, min(end, len(tokens))):
            masks[j] = tokens[j]
    if (
        finish_reason == "length"
        and tokens
        and tokens[-1] == getattr(tokenizer, "eos_token_id", None)
    ):
        tokens = tokens[:-1]
        masks = masks[:-1]
    out: Dict[str, Any] = {"tokens": tokens, "masks": masks}
    if include_messages:
        out["messages"] = chat
    return out


__all__ = ["MASK_ID", "UNMASKED_ROLES", "chat_token_ids", "tokenize_for_trainer"]
