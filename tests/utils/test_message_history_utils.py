"""strip_thinking, truncate_thinking and ensure_trajectory_token_limit."""

from __future__ import annotations

import pytest

from atroposlib.utils.message_history_utils import (
    ensure_trajectory_token_limit,
    strip_thinking,
    truncate_thinking,
)
from atroposlib.utils.tokenize_for_trainer import MASK_ID, tokenize_for_trainer


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>let me see</think>The answer is 4.", "The answer is 4."),
        ("a<think>x</think>b<think>y</think>c", "abc"),
        ("reasoning without open tag</think> final", "final"),
        ("answer first <think>never closed", "answer first"),
        ("no thinking at all", "no thinking at all"),
        ("", ""),
    ],
)
def test_strip_thinking(text, expected):
    assert strip_thinking(text) == expected


def test_truncate_thinking_keeps_the_tail_of_the_reasoning(chat_tokenizer):
    inner = " ".join(f"w{i}" for i in range(200))
    text = f"<think>{inner}</think>final answer"
    out = truncate_thinking(text, chat_tokenizer, 10)
    assert out.startswith("<think>...") and out.endswith("</think>final answer")
    assert "w199" in out and "w0 " not in out
    kept = out[len("<think>...") : out.index("</think>")]
    assert len(chat_tokenizer.encode(kept, add_special_tokens=False)) <= 11
    assert truncate_thinking("<think>short</think>x", chat_tokenizer, 50) == "<think>short</think>x"
    assert truncate_thinking("no block", chat_tokenizer, 1) == "no block"
    with pytest.raises(ValueError):
        truncate_thinking(text, chat_tokenizer, -1)


def _group(tokenizer, chats):
    encoded = [tokenize_for_trainer(tokenizer, c) for c in chats]
    return {
        "tokens": [e["tokens"] for e in encoded],
        "masks": [e["masks"] for e in encoded],
        "scores": [1.0] * len(chats),
        "messages": chats,
        "inference_logprobs": [[1.0]] * len(chats),
    }


def _long_chat(n_turns, final):
    chat = [{"role": "system", "content": "sys"}]
    for i in range(n_turns):
        chat += [
            {"role": "user", "content": f"question {i} " * 5},
            {"role": "assistant", "content": f"answer {i} " * 5},
        ]
    chat += [{"role": "user", "content": "last"}, {"role": "assistant", "content": final}]
    return chat


def test_trajectory_limit_trims_oldest_turns_keeps_system_and_final(chat_tokenizer):
    short = _group(chat_tokenizer, [_long_chat(0, "ok"), _long_chat(0, "fine")])
    long = _group(chat_tokenizer, [_long_chat(6, "ok"), _long_chat(6, "fine")])
    limit = max(len(t) for t in short["tokens"]) + 40
    assert max(len(t) for t in long["tokens"]) > limit
    out = ensure_trajectory_token_limit([short, long], chat_tokenizer, limit)
    assert out[0] is short
    trimmed = out[1]
    for tokens, masks, messages in zip(
        trimmed["tokens"], trimmed["masks"], trimmed["messages"], strict=True
    ):
        assert len(tokens) == len(masks) <= limit
        assert messages[0]["role"] == "system" and messages[-1]["content"] in ("ok", "fine")
        assert [m for m in masks if m != MASK_ID]
    assert trimmed["inference_logprobs"] is None  # no longer aligned, so not sent
    assert long["messages"][0][1]["content"].startswith("question 0")  # input untouched


def test_trajectory_limit_drops_groups_that_cannot_fit(chat_tokenizer):
    group = _group(chat_tokenizer, [_long_chat(2, "x " * 50)])
    assert ensure_trajectory_token_limit([group], chat_tokenizer, 5) == []
    no_messages = {"tokens": [[1] * 50], "masks": [[1] * 50], "scores": [0.0]}
    assert ensure_trajectory_token_limit([no_messages], chat_tokenizer, 10) == []
