"""The proxy's session bounds: how many sessions, for how long unused, how many nodes each,
how many tokens in all — with a clock injected (no sleeping), in the app, and in a proxy
process with small limits; and the upstream policy's name resolution."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import httpx
import pytest

from atroposlib.envs.server_handling.managed_server_proxy import ProxyState, create_app, main
from atroposlib.envs.server_handling.server_harness import ServerHarness
from atroposlib.envs.server_handling.server_manager import ServerManager
from atroposlib.http.openai_protocol import OpenAIError
from atroposlib.proxy import state as proxy_state
from atroposlib.proxy.state import SessionLimits, SessionState, SessionStore
from atroposlib.proxy.upstream import UpstreamPolicy
from atroposlib.testing.proxy import running_proxy

USER = [{"role": "user", "content": "Name a color."}]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _session(sid: str, tokens_per_node: list[int] | None = None) -> SessionState:
    nodes = [SimpleNamespace(tokens=[0] * n) for n in tokens_per_node or []]
    managed = SimpleNamespace(current_nodes=nodes, sequences={})
    return SessionState(uuid=sid, managed_server=managed, translator=None, model_name="m")


def test_idle_sessions_are_evicted_and_counted_but_busy_ones_are_kept():
    clock = Clock()
    store = SessionStore(SessionLimits(session_idle_s=60), clock=clock)
    for sid in ("a", "b", "c"):
        store.add(_session(sid, [10, 20]))
        store.account(store.get(sid))
    assert store.stored_tokens == 90
    clock.now += 30
    store.get("a")  # used: its idle time starts again
    store.get("c").in_flight = 1  # a request is running on it
    clock.now += 45
    assert store.expire() == 1 and store.evicted_idle == 1
    assert "b" not in store and "a" in store and "c" in store
    assert store.stored_tokens == 60
    with pytest.raises(OpenAIError) as info:
        store.get("b")
    assert info.value.status == 404 and "evicted" in info.value.message
    clock.now += 1000
    assert store.expire() == 1  # "c" is still busy
    assert [s.uuid for s in store.values()] == ["c"]
    assert store.counters()["sessions_evicted"] == 2


def test_a_full_store_refuses_new_sessions_until_one_ends_or_expires():
    clock = Clock()
    store = SessionStore(SessionLimits(max_sessions=2, session_idle_s=10), clock=clock)
    store.add(_session("a"))
    store.add(_session("b"))
    with pytest.raises(OpenAIError) as info:
        store.add(_session("c"))
    assert info.value.status == 429 and "--max-sessions 2" in info.value.message
    assert store.refused_sessions == 1
    store.remove("a")
    store.add(_session("c"))
    clock.now += 11
    store.add(_session("d"))  # "b" and "c" expired to make room
    assert [s.uuid for s in store.values()] == ["d"] and store.evicted_idle == 2


def test_generations_that_could_pass_the_node_or_token_bounds_are_refused_up_front():
    store = SessionStore(SessionLimits(max_session_nodes=4, max_stored_tokens=1000))
    full = _session("full", [100, 100, 100])
    other = _session("other", [300])
    for session in (full, other):
        store.add(session)
        store.account(session)
    assert store.stored_tokens == 600
    with pytest.raises(OpenAIError) as info:
        store.admit(full, n=2, max_new_tokens=1, prompt_bound=1)
    assert info.value.status == 429 and info.value.param == "n"
    running = store.admit(full, n=1, max_new_tokens=100, prompt_bound=100)
    with pytest.raises(OpenAIError) as info:
        store.admit(full, n=1, max_new_tokens=1, prompt_bound=1)  # 3 + 1 running + 1 > 4
    assert info.value.status == 429
    with pytest.raises(OpenAIError) as info:
        store.admit(other, n=1, max_new_tokens=100, prompt_bound=150)  # 600 + 200 running + 250
    assert info.value.status == 503 and "--max-stored-tokens 1000" in info.value.message
    store.release(full, 1, running)  # the running request ended without storing a node
    store.admit(other, n=1, max_new_tokens=100, prompt_bound=150)
    with pytest.raises(OpenAIError) as info:
        store.admit(other, n=2, max_new_tokens=100, prompt_bound=150)  # 600 + 250 + 500
    assert info.value.status == 503
    with pytest.raises(OpenAIError) as info:
        store.admit(other, n=3, max_new_tokens=100, prompt_bound=300)  # 1200 alone
    assert info.value.status == 400 and info.value.param == "n"
    full.managed_server.current_nodes.clear()  # reset
    store.account(full)
    assert store.stored_tokens == 300 and full.num_nodes == 0
    store.admit(other, n=1, max_new_tokens=100, prompt_bound=150)  # 300 + 250 + 250
    assert store.counters()["requests_refused_nodes"] == 2
    assert store.counters()["requests_refused_tokens"] == 3


def test_setup_names_must_resolve_to_loopback_and_connections_only_reach_allowed_addresses():
    table = {
        "localhost": ["127.0.0.1", "::1"],
        "foo.localhost": ["10.1.2.3"],
        "mixed.localhost": ["127.0.0.1", "192.168.0.9"],
        "gpu1": ["10.0.0.7"],
    }

    def resolve(host: str, port: int) -> list[str]:
        if host not in table:
            raise OSError("Name or service not known")
        return table[host]

    policy = UpstreamPolicy(["gpu1"], resolve=resolve)
    assert policy.setup_problem("http://localhost:9000/v1") is None
    assert policy.setup_problem("http://127.0.0.1:9000/v1") is None
    assert policy.setup_problem("http://[::1]:9000/v1") is None
    assert policy.setup_problem("http://gpu1:9000/v1") is None  # listed: any address
    assert "10.1.2.3" in policy.setup_problem("http://foo.localhost:9000/v1")
    assert "192.168.0.9" in policy.setup_problem("http://mixed.localhost/v1")
    assert "does not resolve" in policy.setup_problem("http://ip6-localhost/v1")
    assert "--allow-upstream" in policy.setup_problem("http://evil.example/v1")
    # At connect time: the address used, whatever the name resolved to at setup.
    assert policy.peer_allowed("foo.localhost", "127.0.0.1")
    assert not policy.peer_allowed("foo.localhost", "10.1.2.3")
    assert policy.peer_allowed("localhost", "::ffff:127.0.0.1")
    assert policy.peer_allowed("gpu1", "10.0.0.7")


async def test_evicted_sessions_show_in_health_and_answer_404(tokenizer):
    manager = ServerManager.__new__(ServerManager)
    manager.servers = [ServerHarness()]
    app = create_app(manager, tokenizer, limits=SessionLimits(session_idle_s=5))
    clock = Clock()
    app.state.proxy.sessions.clock = clock
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        first = (await client.post("/sessions/create", json={})).json()
        assert first["tool_parser"] == "hermes"
        clock.now += 3
        second = (await client.post("/sessions/create", json={"tool_parser": None})).json()
        assert second["tool_parser"] is None
        clock.now += 3
        health = (await client.get("/health")).json()
        assert health["sessions"] == 1 and health["sessions_evicted"] == 1
        gone = await client.get(f"/{first['uuid']}/nodes")
        assert gone.status_code == 404 and "evicted" in gone.json()["error"]["message"]
        assert (await client.get(f"/{second['uuid']}/nodes")).status_code == 200


@pytest.fixture(scope="module")
def small_proxy(fake_pool, tokenizer, tmp_path_factory):
    """A proxy process with small bounds over a vLLM-style fake."""
    with running_proxy(
        tmp_path_factory.mktemp("small-proxy"),
        [{"base_url": fake_pool[1].base_url, "server_type": "vllm"}],
        "--max-sessions",
        "2",
        "--max-session-nodes",
        "3",
        "--max-stored-tokens",
        "20000",
        tokenizer=tokenizer,
    ) as proxy:
        yield proxy.url


def test_a_proxy_process_bounds_sessions_nodes_and_request_size(small_proxy):
    """Before: 8,000 sessions were created and kept, and n=1000 stored 1,000 nodes."""
    url = small_proxy
    sids = [httpx.post(f"{url}/sessions/create", json={}).json()["uuid"] for _ in range(2)]
    full = httpx.post(f"{url}/sessions/create", json={})
    assert full.status_code == 429, full.text
    assert full.json()["error"]["type"] == "rate_limit_error"
    assert "--max-sessions 2" in full.json()["error"]["message"]

    chat = f"{url}/{sids[0]}/v1/chat/completions"
    first = httpx.post(chat, json={"messages": USER, "n": 3, "max_tokens": 4}, timeout=60)
    assert first.status_code == 200 and len(first.json()["choices"]) == 3, first.text
    more = httpx.post(chat, json={"messages": USER, "max_tokens": 4}, timeout=60)
    assert more.status_code == 429 and more.json()["error"]["param"] == "n", more.text
    assert "--max-session-nodes" in more.json()["error"]["message"]
    assert httpx.post(f"{url}/{sids[0]}/reset").status_code == 200
    again = httpx.post(chat, json={"messages": USER, "max_tokens": 4}, timeout=60)
    assert again.status_code == 200, again.text

    big = [{"role": "user", "content": "x" * 8000}]
    huge = httpx.post(chat, json={"messages": big, "n": 3, "max_tokens": 4}, timeout=60)
    assert huge.status_code == 400 and huge.json()["error"]["param"] == "n", huge.text
    assert "--max-stored-tokens 20000" in huge.json()["error"]["message"]

    health = httpx.get(f"{url}/health").json()
    assert health["sessions_refused"] == 1 and health["requests_refused_nodes"] == 1
    assert health["requests_refused_tokens"] == 1 and health["stored_tokens"] > 0
    listed = {s["uuid"]: s for s in httpx.get(f"{url}/sessions").json()["sessions"]}
    assert listed[sids[0]]["num_nodes"] == 1 and listed[sids[0]]["stored_tokens"] > 0

    assert httpx.delete(f"{url}/{sids[1]}").status_code == 200
    assert httpx.post(f"{url}/sessions/create", json={}).status_code == 200


def test_every_session_limit_is_a_proxy_flag_with_its_default_and_help(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for limit in dataclasses.fields(SessionLimits):
        assert f"--{limit.name.replace('_', '-')}" in help_text
        assert " ".join(limit.metadata["help"].split()) in help_text
    assert isinstance(SessionLimits().session_idle_s, float)


def test_the_proxy_names_a_missing_or_unloadable_tokenizer_and_loads_each_name_once(
    monkeypatch,
):
    loads: list[str] = []
    monkeypatch.setattr(proxy_state, "load_tokenizer", loads.append)  # always None
    state = ProxyState()
    nameless = SimpleNamespace(config=SimpleNamespace(tokenizer_name="none", model_name=""))
    with pytest.raises(OpenAIError, match="no tokenizer configured") as info:
        state.tokenizer_for(nameless)
    assert info.value.status == 409 and info.value.param == "tokenizer"
    named = SimpleNamespace(config=SimpleNamespace(tokenizer_name="org/tok"))
    for _ in range(2):
        with pytest.raises(OpenAIError, match="could not load tokenizer 'org/tok'") as info:
            state.tokenizer_for(named)
        assert info.value.status == 409
    assert loads == ["org/tok"]
    assert ProxyState(tokenizer="given").tokenizer_for(named) == "given"
    assert state.tokenizer_for(SimpleNamespace(tokenizer="own", config=None)) == "own"
