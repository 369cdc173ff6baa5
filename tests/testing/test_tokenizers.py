"""``atroposlib.testing.tokenizers``: the in-memory tokenizers have the shapes tests rely on."""

from __future__ import annotations

from atroposlib.testing.tokenizers import bytes_tokenizer, chatml_tokenizer, llama_style_tokenizer

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


def test_chatml_tokenizer_has_no_bos_and_renders_chatml():
    tok = chatml_tokenizer()
    assert tok.bos_token is None and tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode("The answer is 42.")
    assert tok.decode(ids) == "The answer is 42."


def test_llama_style_tokenizer_adds_bos_and_its_template_may_write_it_too():
    plain, writes_bos = llama_style_tokenizer(), llama_style_tokenizer(template_writes_bos=True)
    bos = plain.convert_tokens_to_ids("<s>")
    assert plain.encode("Hello")[0] == bos
    assert plain.encode("Hello", add_special_tokens=False)[0] != bos
    rendered = writes_bos.apply_chat_template(MESSAGES, tokenize=False)
    assert rendered.startswith("<s>") and not plain.apply_chat_template(
        MESSAGES, tokenize=False
    ).startswith("<s>")


def test_bytes_tokenizer_spends_one_token_per_byte():
    tok = bytes_tokenizer()
    for text in ["abc", "héllo", "two words"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == len(text.encode()) and tok.decode(ids) == text
