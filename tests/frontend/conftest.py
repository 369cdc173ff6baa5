"""Fixtures for the frontend tests (rollouts, export, viewers): see :mod:`tests.frontend.fixtures`."""

from tests.frontend.fixtures import make_group, tokenizer, tokenizer_dir

__all__ = ["make_group", "tokenizer", "tokenizer_dir"]
