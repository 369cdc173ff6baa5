"""The drop-in tests share the session's ``serve_model`` (tests/conftest.py) with the
environment tests."""
