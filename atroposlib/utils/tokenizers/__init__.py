"""Tokenizer helpers (chat templates that keep what training needs)."""
