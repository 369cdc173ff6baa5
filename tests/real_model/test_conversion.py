"""The converted real model: a plain fp32 safetensors Llama with SmolLM2's tokenizer and
ChatML template, cached (a second call converts nothing)."""

from __future__ import annotations

import json

from atroposlib.tiny_model import real_model


def test_converted_directory_is_a_plain_checkpoint_with_its_template(
    real_model_dir, real_tokenizer
):
    config = json.loads((real_model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    assert config["vocab_size"] == len(real_tokenizer) == 49152
    assert "quantization_config" not in config  # loads without gguf
    assert (real_model_dir / "model.safetensors").stat().st_size > 500e6  # fp32, 134.5M params
    text = real_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\n") and text.endswith(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert real_tokenizer.eos_token == "<|im_end|>"
    assert real_tokenizer.pad_token != real_tokenizer.eos_token


def test_a_second_call_returns_the_cache_without_converting(real_model_dir, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(real_model, "convert_gguf", refuse)
    assert real_model.ensure_real_model() == str(real_model_dir)
