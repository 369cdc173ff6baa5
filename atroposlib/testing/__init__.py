"""Test doubles and shared helpers for the test suite and the benchmarks.

Nothing under ``atroposlib/`` outside this package imports it: the product never
depends on a fake. ``fake_server`` is a deterministic OpenAI/vLLM/SGLang/TRL-speaking
inference server; ``lean_http`` is the minimal HTTP/1.1 server it can run on so that,
in benchmarks, the stand-in costs far less CPU than the client under test.
"""
