"""The texts a later prompt may continue a ``ManagedServer`` node from.

A node's ``full_text`` keeps the special tokens the model sampled (it is what its tokens
say), but the completion an environment receives is decoded without them, and the next
turn's prompt is rendered from that. A reply such as ``ab<|im_start|>cd<|im_end|>`` reaches
the environment as ``abcd``, and the chat template then writes its own end of turn after it,
so the next prompt begins ``...abcd<|im_end|>\\n<|im_start|>user``: it does not start with
the node's ``full_text``, and without more the conversation would split into a new sequence
whose prompt re-tokenizes the reply (tokens the policy never produced, no trained span).

So each completion also yields the texts the environment may have built on, and a prompt
that starts with any of them continues the node (its tokens reused verbatim):

1. the raw text (special tokens kept): an environment that keeps them, or a reply without any;
2. the text with the special tokens inside the reply dropped but a trailing run kept (the
   end-of-turn that stopped it): the next prompt's template writes that end of turn, and
   matching it here keeps it from being encoded a second time;
3. the text without special tokens: what the environment was given.

The longest text a prompt starts with wins (:func:`continued_text`).
"""

from __future__ import annotations

from typing import Any, Iterable


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids that ``decode(..., skip_special_tokens=True)`` drops: the named special tokens
    and every added token marked special (chat markers such as ``<|im_start|>`` are often
    only the latter)."""
    ids = {int(i) for i in (getattr(tokenizer, "all_special_ids", None) or [])}
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    if isinstance(decoder, dict):
        ids.update(int(i) for i, token in decoder.items() if getattr(token, "special", False))
    return frozenset(ids)


def completion_texts(
    tokenizer: Any, output_ids: list[int], specials: frozenset[int]
) -> tuple[str, str, tuple[str, ...]]:
    """``(raw, shown, others)`` for one completion's ``output_ids``: the raw decode (special
    tokens kept), the decode the caller is shown (without them) and the further texts a
    continuing prompt may hold in its place (see the module doc; empty when the completion
    has no special token)."""
    raw = tokenizer.decode(output_ids, skip_special_tokens=False)
    if not any(t in specials for t in output_ids):
        return raw, raw, ()
    shown = tokenizer.decode(output_ids, skip_special_tokens=True)
    tail = len(output_ids)
    while tail > 0 and output_ids[tail - 1] in specials:
        tail -= 1
    kept = [t for t in output_ids[:tail] if t not in specials] + list(output_ids[tail:])
    ended = tokenizer.decode(kept, skip_special_tokens=False)
    return raw, shown, tuple(dict.fromkeys(t for t in (ended, shown) if t != raw))


def continued_text(full_text: str, others: Iterable[str], input_text: str) -> str | None:
    """The longest of ``full_text`` and ``others`` that ``input_text`` starts with, or None."""
    best: str | None = None
    for text in (full_text, *others):
        if input_text.startswith(text) and (best is None or len(text) > len(best)):
            best = text
    return best
