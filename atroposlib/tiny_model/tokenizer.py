"""The shipped byte-level BPE tokenizer and its ChatML chat template."""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerFast

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
TOKENIZER_JSON = ASSETS_DIR / "tokenizer.json"
CHAT_TEMPLATE_FILE = ASSETS_DIR / "chat_template.jinja"

PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
# (token, is_special): special tokens are dropped by ``skip_special_tokens`` decoding;
# the reasoning/tool markers are not, so parsers downstream still see them.
SPECIAL_TOKENS: tuple[tuple[str, bool], ...] = (
    (PAD_TOKEN, True),
    ("<|im_start|>", True),
    (EOS_TOKEN, True),
    ("<think>", False),
    ("</think>", False),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
)


def chat_template() -> str:
    """Return the ChatML chat template (supports ``tools`` and ``add_generation_prompt``)."""
    return CHAT_TEMPLATE_FILE.read_text(encoding="utf-8")


def load_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Load the shipped tokenizer as a ``PreTrainedTokenizerFast`` with ChatML settings.

    Example::

        tok = load_tiny_tokenizer()
        ids = tok.apply_chat_template([{"role": "user", "content": "2+2?"}],
                                      add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
    """
    if not TOKENIZER_JSON.exists():
        raise FileNotFoundError(
            f"{TOKENIZER_JSON} is missing; run `python scripts/build_tiny_tokenizer.py`"
        )
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER_JSON),
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=chat_template(),
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    return tok
