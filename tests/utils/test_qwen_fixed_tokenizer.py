"""The fixed Qwen template renders earlier reasoning and tool turns verbatim."""

from __future__ import annotations

import copy

from atroposlib.utils.tokenizers.qwen_fixed_tokenizer import (
    apply_qwen_fixed_template,
    qwen_fixed_chat_template,
)


def test_fixed_template_keeps_think_blocks_of_earlier_turns(chat_tokenizer):
    tok = apply_qwen_fixed_template(copy.deepcopy(chat_tokenizer))
    assert tok.chat_template == qwen_fixed_chat_template()
    chat = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "<think>r1</think>a1"},
        {"role": "tool", "content": '{"x": 1}'},
        {"role": "user", "content": "q2"},
    ]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert "<think>r1</think>a1" in text
    assert '<tool_response>\n{"x": 1}\n</tool_response>' in text
    assert text.startswith("<|im_start|>system\nS<|im_end|>") and text.endswith(
        "<|im_start|>assistant\n"
    )
    shorter = tok.apply_chat_template(chat[:3], tokenize=False)
    assert text.startswith(shorter)  # prefix-stable across turns
