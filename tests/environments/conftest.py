"""The environment tests share the session's ``serve_model`` (tests/conftest.py): one real
``atropos-serve-model`` on the offline tiny model (helpers live in ``env_helpers.py``)."""
