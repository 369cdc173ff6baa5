"""Fixtures for the utilities tests: a real byte-level BPE tokenizer with a ChatML template."""

from __future__ import annotations

import pytest

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_throwaway_tokenizer():
    """A small byte-level BPE tokenizer trained in memory, ChatML template, eos <|im_end|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [
        "system user assistant The answer is 42. Let me think step by step.",
        "<think> reasoning </think> \\boxed{72} hello world tool call",
    ] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.chat_template = CHATML
    return fast


@pytest.fixture(scope="session")
def chat_tokenizer():
    """The tiny model's tokenizer when its kit is available, else a throwaway one."""
    try:
        from transformers import AutoTokenizer

        from atroposlib.tiny_model import ensure_tiny_model

        return AutoTokenizer.from_pretrained(ensure_tiny_model())
    except Exception:  # kit not available yet in this checkout: fall back, same shape
        return build_throwaway_tokenizer()
