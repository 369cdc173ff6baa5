"""Session affinity: a trajectory's requests stay on one server while it is healthy, move
when it fails, and carry ``X-Session-ID`` on the wire."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

from atroposlib.envs.server_handling.errors import ServerConnectionError
from atroposlib.envs.server_handling.managed_server import ManagedServer
from atroposlib.envs.server_handling.server_baseline import APIServer, APIServerConfig
from atroposlib.envs.server_handling.server_manager import ServerManager
from atroposlib.envs.server_handling.session_affinity import CURRENT_SESSION, in_session
from atroposlib.testing.processes import stop_process
from tests.fake_servers import fake_servers

USER = [{"role": "user", "content": "2+2?"}]


class TokenServer(APIServer):
    """A backend answering tokens and chat in-process, recording the session of each call;
    ``down`` makes its calls fail as an unreachable server's do."""

    def __init__(self, name: str, slots: int = 4):
        super().__init__(
            APIServerConfig(model_name="m", base_url=f"http://{name}/v1", health_check=False)
        )
        self.sem.max_val = self.sem._value = slots  # type: ignore[attr-defined]
        self.seen: list[str | None] = []
        self.down = False
        self.gate: asyncio.Event | None = None

    async def _answer(self) -> None:
        self.seen.append(CURRENT_SESSION.get())
        if self.gate is not None:
            await self.gate.wait()
        if self.down:
            raise ServerConnectionError("POST", self.config.base_url, ConnectionRefusedError())

    async def _chat_completion_wrapper(self, **kwargs: Any) -> Any:
        await self._answer()
        return "chat"

    async def _completion_wrapper(self, **kwargs: Any) -> Any:
        await self._answer()
        return "completion"

    async def _tokens_and_logprobs_completion_wrapper(self, **kwargs: Any) -> Any:
        await self._answer()
        n = kwargs.get("n") or 1
        return list(kwargs["input_ids"]), [[5, 6]] * n, [[-0.5, -0.5]] * n, ["stop"] * n


def _manager(count: int = 3) -> tuple[ServerManager, list[TokenServer]]:
    servers = [TokenServer(f"s{i}") for i in range(count)]
    manager = ServerManager.__new__(ServerManager)
    manager.servers = list(servers)
    return manager, servers


def _where(servers: list[TokenServer], session: str) -> list[int]:
    return [i for i, s in enumerate(servers) for seen in s.seen if seen == session]


async def test_a_session_stays_on_its_server_although_another_has_more_free_slots():
    manager, servers = _manager()
    await in_session("a", manager.chat_completion, messages=USER)
    first = _where(servers, "a")
    assert first == [0] and manager._affinity["a"] == 0
    assert servers[0].sem.try_acquire() and servers[0].sem.try_acquire()  # server 0 now busiest
    for _ in range(5):
        await in_session("a", manager.chat_completion, messages=USER)
    assert _where(servers, "a") == [0] * 6
    await manager.chat_completion(messages=USER)  # without a session: the freest server
    assert servers[1].seen == [None] and "a" in manager._affinity and len(manager._affinity) == 1


async def test_a_session_waits_for_a_slot_on_its_server_instead_of_moving():
    manager, servers = _manager(2)
    manager._pin("b", 1)
    while servers[1].sem.try_acquire():
        pass  # server 1 full
    call = asyncio.ensure_future(in_session("b", manager.chat_completion, messages=USER))
    await asyncio.sleep(0.05)
    assert not call.done() and servers[0].seen == []
    servers[1].sem.release()
    assert await asyncio.wait_for(call, 5) == "chat"
    assert _where(servers, "b") == [1]


async def test_a_failed_server_moves_the_session_and_it_is_pinned_to_the_new_one():
    manager, servers = _manager(3)
    manager._pin("c", 1)
    await in_session("c", manager.chat_completion, messages=USER)
    servers[1].down = True
    assert await in_session("c", manager.chat_completion, messages=USER) == "chat"
    moved_to = manager._affinity["c"]
    assert moved_to != 1
    for _ in range(4):
        await in_session("c", manager.chat_completion, messages=USER)
    assert _where(servers, "c") == [1, 1] + [moved_to] * 5 or sorted(
        _where(servers, "c")
    ) == sorted([1, 1] + [moved_to] * 5)
    assert servers[moved_to].seen.count("c") == 5


async def test_an_unhealthy_pinned_server_is_left_without_being_tried():
    manager, servers = _manager(2)
    manager._pin("d", 0)
    servers[0]._server_healthy = False
    await in_session("d", manager.chat_completion, messages=USER)
    assert servers[0].seen == [] and _where(servers, "d") == [1] and manager._affinity["d"] == 1


async def test_managed_server_turns_share_one_session_pinned_then_unpinned(tokenizer):
    manager, servers = _manager(3)
    assert servers[0].sem.try_acquire()  # the first turn goes to the freest server
    async with manager.managed_server(tokenizer=tokenizer) as managed:
        assert isinstance(managed, ManagedServer)
        session = managed.session_id
        await managed.chat_completion(messages=USER, max_tokens=2)
        pinned = manager._affinity[session]
        assert pinned != 0
        await managed.chat_completion(messages=USER, max_tokens=2)
        servers[pinned].down = True  # its server fails between turns: the trajectory goes on
        await managed.chat_completion(messages=USER, max_tokens=2)
        await managed.chat_completion(messages=USER, max_tokens=2)
        assert manager._affinity[session] != pinned
        assert len(managed.get_state()["nodes"]) == 4
    where = _where(servers, session)
    # turns 1-2 on the first server, turn 3 tried there and moved, turn 4 on the new one
    assert where[:3] == [pinned] * 3 and len(set(where[3:])) == 1 and where[-1] != pinned
    assert session not in manager._affinity  # unpinned when the trajectory ends


async def test_two_managed_servers_have_different_sessions(tokenizer):
    manager, _ = _manager(2)
    async with manager.managed_server(tokenizer=tokenizer) as a:
        async with manager.managed_server(tokenizer=tokenizer) as b:
            await a.chat_completion(messages=USER, max_tokens=2)
            await b.chat_completion(messages=USER, max_tokens=2)
            assert a.session_id != b.session_id and len(manager._affinity) == 2
    assert manager._affinity == {}


async def test_sessions_over_http_stay_on_one_server_and_move_when_it_is_killed(
    tmp_path, tokenizer
):
    """Two fake inference servers as processes; six trajectories (``managed_server()``)
    of three turns each: each trajectory's requests reach one server with its
    X-Session-ID, the trajectories spread over both; after one server is killed, the next
    turns of all of them land on the other."""
    with fake_servers(2, tmp_path=tmp_path) as (one, two):
        configs = [
            APIServerConfig(base_url=s.base_url, model_name="fake", server_type="vllm", timeout=10)
            for s in (one, two)
        ]
        manager = ServerManager(configs)
        killed = asyncio.Event()
        moved = asyncio.Event()
        sessions: list[str] = []
        before: list[dict[str, int]] = []

        async def trajectory() -> None:
            async with manager.managed_server(tokenizer=tokenizer) as managed:
                sessions.append(managed.session_id)
                for _ in range(3):
                    await managed.chat_completion(messages=USER, max_tokens=2)
                    await asyncio.sleep(0)
                await killed.wait()
                for _ in range(2):
                    await managed.chat_completion(messages=USER, max_tokens=2)
                moved.set()

        async def killer() -> None:
            while len(before) == 0:
                await asyncio.sleep(0.05)
            one.proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(one.proc.wait, 10)
            killed.set()

        try:
            tasks = [asyncio.ensure_future(trajectory()) for _ in range(6)]
            kill = asyncio.ensure_future(killer())
            while (
                len(sessions) < 6
                or sum(
                    sum(c.get(sid, 0) for sid in sessions)
                    for c in (one.stats()["sessions"], two.stats()["sessions"])
                )
                < 18
            ):
                await asyncio.sleep(0.05)
            before.extend([one.stats()["sessions"], two.stats()["sessions"]])
            await asyncio.wait_for(asyncio.gather(kill, *tasks), 60)
            home = {}
            for sid in sessions:
                counts = [before[0].get(sid, 0), before[1].get(sid, 0)]
                assert sorted(counts) == [0, 3], (sid, counts)  # all three on one server
                home[sid] = counts.index(3)
            assert set(home.values()) == {0, 1}  # the trajectories were spread over both
            after = two.stats()["sessions"]
            for sid in sessions:
                assert after.get(sid, 0) == before[1].get(sid, 0) + 2, sid
        finally:
            await manager.close()
            stop_process(one.proc)
