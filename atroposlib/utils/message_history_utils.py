"""Helpers for long multi-turn histories: drop or shorten ``<think>`` blocks and keep
trajectories under a token budget.

Example::

    strip_thinking("<think>let me see</think>The answer is 4.")  # -> "The answer is 4."
"""

from __future__ import annotations

import copy
import logging
import re
from typing import Any, Dict, List, Sequence

from atroposlib.utils.tokenize_for_trainer import tokenize_for_trainer

logger = logging.getLogger(__name__)

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)


def strip_thinking(response_text: str) -> str:
    """Remove reasoning from ``response_text``.

    Removes every complete ``<think>...</think>`` block; text before a ``</think>``
    without an opening tag (a template that opens the block in the prompt) and an
    unterminated trailing ``<think>...`` are removed too. Surrounding whitespace is
    stripped.
    """
    text = _THINK_BLOCK.sub("", response_text)
    if THINK_CLOSE in text:
        text = text.rsplit(THINK_CLOSE, 1)[1]
    if THINK_OPEN in text:
        text = text.split(THINK_OPEN, 1)[0]
    return text.strip()


def truncate_thinking(response_text: str, tokenizer: Any, max_think_tokens: int) -> str:
    """Shorten the first ``<think>`` block to its last ``max_think_tokens`` tokens.

    The end of the reasoning (where the conclusion usually is) is kept and the cut is
    marked with ``"..."``. Text outside the block is untouched; a response without a
    complete block is returned unchanged.

    Raises:
        ValueError: when ``max_think_tokens`` is negative.
    """
    if max_think_tokens < 0:
        raise ValueError("max_think_tokens must be >= 0")
    response = response_text
    start = response.find(THINK_OPEN)
    end = response.find(THINK_CLOSE, start + len(THINK_OPEN)) if start != -1 else -1
    if start == -1 or end == -1:
        return response
    inner = response[start + len(THINK_OPEN) : end]
    ids = tokenizer.encode(inner, add_special_tokens=False)
    if len(ids) <= max_think_tokens:
        return response
    kept = tokenizer.decode(ids[len(ids) - max_think_tokens :]) if max_think_tokens else ""
    return response[:start] + THINK_OPEN + "..." + kept + response[end:]


def _trim_messages(messages: List[Dict[str, Any]]) -> List[Dict[str, Any]] | None:
    """Drop the oldest non-system turn (keeping the final message); None if impossible."""
    first = 1 if messages and messages[0].get("role") == "system" else 0
    if len(messages) - first <= 1:
        return None
    drop_until = first + 1
    # drop a whole exchange: the turn plus the replies that follow up to the next user turn
    while drop_until < len(messages) - 1 and messages[drop_until].get("role") != "user":
        drop_until += 1
    return messages[:first] + messages[drop_until:]


def ensure_trajectory_token_limit(
    trajectory: Sequence[Dict[str, Any]],
    tokenizer: Any,
    max_trajectory_tokens: int,
) -> List[Dict[str, Any]]:
    """Keep every group of ``trajectory`` within ``max_trajectory_tokens`` tokens.

    Each group (a ScoredDataGroup with ``messages``) whose longest sequence is too long
    has the oldest exchanges of *all* its alternatives removed together (the system
    prompt and the final turn are kept) and is re-tokenized with
    :func:`tokenize_for_trainer`. A group that cannot fit, or that has no messages to
    trim, is dropped with a warning. Input groups are not modified.
    """
    kept: List[Dict[str, Any]] = []
    for index, group in enumerate(trajectory):
        tokens = group.get("tokens") or []
        if all(len(t) <= max_trajectory_tokens for t in tokens):
            kept.append(group)
            continue
        messages = group.get("messages")
        if not messages:
            logger.warning(
                "dropping step %d: over %d tokens and no messages to trim",
                index,
                max_trajectory_tokens,
            )
            continue
        alternatives = [list(m) for m in messages]
        fitted = None
        while True:
            trimmed = [_trim_messages(m) for m in alternatives]
            if any(t is None for t in trimmed):
                break
            alternatives = trimmed  # type: ignore[assignment]
            encoded = [tokenize_for_trainer(tokenizer, m) for m in alternatives]
            if all(len(e["tokens"]) <= max_trajectory_tokens for e in encoded):
                fitted = encoded
                break
        if fitted is None:
            logger.warning(
                "dropping step %d: cannot fit within %d tokens", index, max_trajectory_tokens
            )
            continue
        new_group = copy.copy(group)
        new_group["tokens"] = [e["tokens"] for e in fitted]
        new_group["masks"] = [e["masks"] for e in fitted]
        new_group["messages"] = alternatives
        # per-token fields no longer align with the re-tokenized sequences
        for key in ("inference_logprobs", "ref_logprobs", "advantages"):
            if new_group.get(key) is not None:
                new_group[key] = None
        kept.append(new_group)
    return kept


__all__ = ["ensure_trajectory_token_limit", "strip_thinking", "truncate_thinking"]
