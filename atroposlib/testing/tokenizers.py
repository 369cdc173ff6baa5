"""Small byte-level BPE tokenizers built in memory, for tests that need a real
``PreTrainedTokenizerFast`` without downloading one.

- :func:`chatml_tokenizer`: trained BPE, ChatML template, eos ``<|im_end|>``, no BOS (the shape
  of Qwen-style tokenizers).
- :func:`llama_style_tokenizer`: trained BPE whose encoder adds a BOS ``<s>``; with
  ``template_writes_bos=True`` its chat template writes ``<s>`` itself (as Llama 3's writes
  ``<|begin_of_text|>``), the case where encoding the rendered prompt with special tokens would
  double the BOS.
- :func:`bytes_tokenizer`: no merges, one token per byte (lengths are predictable).

All three share :func:`byte_level_bpe`.
"""

from __future__ import annotations

from typing import Sequence

__all__ = [
    "CHATML_TEMPLATE",
    "byte_level_bpe",
    "bytes_tokenizer",
    "chatml_tokenizer",
    "llama_style_tokenizer",
]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_LLAMA_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_level_bpe(
    corpus: Sequence[str] | None,
    special_tokens: Sequence[str],
    vocab_size: int = 600,
    bos: str | None = None,
):
    """A ``tokenizers.Tokenizer`` with byte-level pre-tokenizer and decoder.

    With a ``corpus`` it is trained (20 passes over it) up to ``vocab_size``; without one its
    vocabulary is the 256 byte symbols and no merges. With ``bos`` the encoder prepends that
    token when asked for special tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if corpus is None:
        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    else:
        tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if corpus is not None:
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(special_tokens),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(list(corpus) * 20, trainer)
    if bos is not None:
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return tok


def chatml_tokenizer():
    """A ``PreTrainedTokenizerFast``: ChatML template, eos ``<|im_end|>``, pad
    ``<|endoftext|>``, no BOS."""
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "system user assistant The answer is 42. Let me think step by step.",
        "<think> reasoning </think> \\boxed{72} hello world tool call",
    ]
    tok = byte_level_bpe(corpus, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], vocab_size=600)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def llama_style_tokenizer(template_writes_bos: bool = False):
    """A ``PreTrainedTokenizerFast`` with bos ``<s>`` (added by ``encode``) and eos ``</s>``."""
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    corpus = ["What is 2+2? The answer is 4. Hello there, six and seven."]
    tok = byte_level_bpe(corpus, specials, vocab_size=400, bos="<s>")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    fast.chat_template = ("{{ bos_token }}" if template_writes_bos else "") + _LLAMA_TEMPLATE
    return fast


def bytes_tokenizer():
    """A ``PreTrainedTokenizerFast`` with one token per byte, eos ``<|im_end|>`` and pad
    ``<|endoftext|>`` (added as new tokens), no chat template."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=byte_level_bpe(None, []),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
