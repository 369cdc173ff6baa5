"""Fixtures for the console-command tests (sft/dpo generators, view-run): see
:mod:`tests.frontend.fixtures`."""

from tests.frontend.fixtures import (
    api_key,
    keyed_api,
    make_group,
    tokenizer,
    tokenizer_dir,
    write_jsonl,
)

__all__ = ["api_key", "keyed_api", "make_group", "tokenizer", "tokenizer_dir", "write_jsonl"]
