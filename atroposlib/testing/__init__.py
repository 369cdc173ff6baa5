"""Test doubles and shared helpers for the test suite and the benchmarks.

Nothing under ``atroposlib/`` outside this package imports it: the product never
depends on a fake. Each helper is written once here and imported by tests and benchmarks:

- ``fake_server``: a deterministic OpenAI/vLLM/SGLang/TRL-speaking inference server (its
  settings, request models and byte tokens in ``fake_model``, its answers in ``fake_payloads``);
  ``lean_http``: the minimal HTTP/1.1 server it can run on so that, in benchmarks, the
  stand-in costs far less CPU than the client under test.
- ``processes``: start a command in its own process group, wait for its health URL, stop it
  and its children.
- ``ports``: a free loopback port, and ``start_on_free_port``, which starts a server again on
  another port when its port was taken before it could bind.
- ``launch``: the command lines of run-api, serve-model, the OpenAI proxy and the fake server.
- ``api``: ``running_api``, run-api as a process (free port, healthy on entry, its log
  file), the one way tests and the shared ``rollout_api``/``keyed_api`` fixtures start it.
- ``proxy``: ``running_proxy``, the OpenAI proxy as a process (its ``servers.json``, its
  tokenizer saved, a free port, healthy on entry), for the tests that need one.
- ``vllm_server``: vLLM's own OpenAI server from ``.venv-vllm`` on a tiny model it can serve
  (head_dim 32), started and stopped as a process group.
- ``trainer``: a fake trainer that registers with run-api and pulls batches like the real one.
- ``tokenizers``: small byte-level BPE tokenizers built in memory.
- ``pipelining`` and ``stalled_uploads``: hostile clients (a pipelining flood, bodies that
  never finish) for the servers' bounds.

Modules are imported by name (``from atroposlib.testing.ports import free_port``); this
package imports none of them, so using one does not load the others.
"""
