"""Fixtures of the drop-in tests: the real ``atropos-serve-model`` on the tiny model, shared
with the environment tests."""

from tests.environments.conftest import serve_model  # noqa: F401  (a session fixture)
