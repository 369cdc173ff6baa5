"""A Llama-style tokenizer built in memory: byte-level BPE whose encoder adds a BOS ``<s>``.

``template_writes_bos=True`` gives it a chat template that writes ``<s>`` itself (as Llama 3's
writes ``<|begin_of_text|>``), the case where encoding the rendered prompt with special tokens
would double the BOS.
"""

from __future__ import annotations

PLAIN_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
BOS_TEMPLATE = "{{ bos_token }}" + PLAIN_TEMPLATE


def build_llama_style_tokenizer(template_writes_bos: bool = False):
    """A ``PreTrainedTokenizerFast`` with bos ``<s>`` (added by ``encode``) and eos ``</s>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["What is 2+2? The answer is 4. Hello there, six and seven."] * 20
    tok.train_from_iterator(corpus, trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    fast.chat_template = BOS_TEMPLATE if template_writes_bos else PLAIN_TEMPLATE
    return fast
