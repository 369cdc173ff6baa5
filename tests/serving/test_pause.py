"""``/pause`` and ``/resume`` on a real ``atropos-serve-model`` process, the version header,
named weight versions and the swap history, and the trainer's ``--sync-mode pause``."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import running_process
from atroposlib.tiny_model import build_tiny_model
from tests.serving.support import serve_cmd


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("pause")
    port = free_port()
    cmd = serve_cmd(tiny_model_dir, port, "--weights-root", str(root), "--swap-drain-timeout", "30")
    with running_process(
        cmd,
        health_url=f"http://127.0.0.1:{port}/health",
        timeout=180,
        log_path=root / "serve.log",
    ):
        yield f"http://127.0.0.1:{port}", root


@pytest.fixture(scope="module")
def checkpoint(server):
    _, root = server
    return build_tiny_model(root / "weights_b", seed=3)


def _long(ids: list[int], tokens: int = 400) -> dict:
    return {
        "prompt": {"prompt_token_ids": ids},
        "max_tokens": tokens,
        "ignore_eos": True,
        "seed": 1,
    }


async def _wait_running(client: httpx.AsyncClient, url: str) -> None:
    deadline = time.monotonic() + 60
    while (await client.get(f"{url}/health")).json()["running"] == 0:
        assert time.monotonic() < deadline, "the long request never started"
        await asyncio.sleep(0.02)


async def test_finish_pause_drains_in_flight_holds_new_and_resume_serves_new_weights(
    server, checkpoint
):
    url, _ = server
    async with httpx.AsyncClient(timeout=120) as client:
        long = asyncio.create_task(client.post(f"{url}/generate", json=_long([5, 6, 7])))
        await _wait_running(client, url)
        paused = await client.post(f"{url}/pause", json={"mode": "finish"})
        assert paused.status_code == 200, paused.text
        assert paused.json()["drained"] is True and paused.json()["paused"] is True
        assert long.done(), "/pause answered before the in-flight request finished"
        old_version = (await long).json()["version"]

        held = asyncio.create_task(client.post(f"{url}/generate", json=_long([8, 9], 4)))
        await asyncio.sleep(0.5)
        assert not held.done()
        assert (await client.get(f"{url}/pause")).json()["held"] == 1

        new_version = old_version + 5
        upd = await client.post(
            f"{url}/update_weights", json={"path": checkpoint, "version": new_version}
        )
        assert upd.status_code == 200 and upd.json()["version"] == new_version
        assert not held.done()
        resumed = await client.post(f"{url}/resume", json={})
        assert resumed.json()["paused"] is False
        answer = await held
        assert answer.json()["version"] == new_version
        assert answer.headers["x-atropos-policy-version"] == str(new_version)
        history = (await client.get(f"{url}/weights_history")).json()
        assert history["swaps"][-1]["version"] == new_version
        assert history["swaps"][-1]["path"] == checkpoint
        stale = await client.post(
            f"{url}/update_weights", json={"path": checkpoint, "version": new_version}
        )
        assert stale.status_code == 400


async def test_hold_pause_stops_stepping_and_resume_continues(server):
    url, _ = server
    async with httpx.AsyncClient(timeout=120) as client:
        long = asyncio.create_task(client.post(f"{url}/generate", json=_long([11, 12], 300)))
        await _wait_running(client, url)
        paused = (await client.post(f"{url}/pause", json={"mode": "hold"})).json()
        assert paused["in_flight"] == 1 and paused["drained"] is False
        steps = (await client.get(f"{url}/health")).json()["steps"]
        await asyncio.sleep(0.6)
        assert (await client.get(f"{url}/health")).json()["steps"] == steps
        assert not long.done()
        await client.post(f"{url}/resume", json={})
        body = (await long).json()
        assert len(body["token_ids"][0]) == 300


async def test_a_forgotten_pause_ends_by_itself(server):
    url, _ = server
    async with httpx.AsyncClient(timeout=60) as client:
        r = await client.post(f"{url}/pause", json={"mode": "finish", "max_pause_seconds": 2})
        assert r.json()["paused"] is True
        held = asyncio.create_task(client.post(f"{url}/generate", json=_long([3, 4], 2)))
        seen_paused = 0
        for _ in range(1200):  # a hang guard: the pause ends by itself after 2 s
            answered_before = held.done()
            if not (await client.get(f"{url}/pause")).json()["paused"]:
                break
            assert not answered_before, "a request was answered while the server was paused"
            seen_paused += 1
            await asyncio.sleep(0.05)
        assert seen_paused > 0
        assert (await held).status_code == 200
        assert (await client.get(f"{url}/pause")).json()["paused"] is False


def test_trainer_sync_mode_pause_holds_requests_until_the_new_weights(server, tiny_model_dir):
    from example_trainer.config import TrainingConfig
    from example_trainer.model import setup_model
    from example_trainer.weight_sync import HttpReloadSync

    url, root = server
    cfg = TrainingConfig(
        model_name=str(tiny_model_dir),
        device="cpu",
        progress=False,
        save_path=str(root / "trainer"),
        weight_bridge_mode="http_reload",
        inference_url=url,
        sync_mode="pause",
        sync_timeout=120,
    )
    model, tok = setup_model(cfg)
    sync = HttpReloadSync(cfg, model, tok)
    sync.start()
    step = sync.last_version + 3
    results: dict = {}

    def run_sync() -> None:
        results["took"] = sync.sync(step)

    with httpx.Client(timeout=120) as client:
        worker = threading.Thread(target=run_sync)
        worker.start()
        deadline = time.monotonic() + 60
        while not client.get(f"{url}/pause").json()["paused"]:
            assert time.monotonic() < deadline and worker.is_alive()
            time.sleep(0.01)
        during = client.post(f"{url}/generate", json=_long([21, 22], 3))
        worker.join(timeout=120)
        assert "took" in results
        assert during.json()["version"] == step == sync.last_version
        from atroposlib.serving.weights_version import read_weights_version

        assert read_weights_version(sync._previous) == step  # a restart would report it too
        assert client.get(f"{url}/pause").json()["paused"] is False


def test_weights_dir_version_is_adopted_on_update_and_at_start(server, tiny_model_dir, tmp_path):
    import shutil

    from atroposlib.serving.app import build_state
    from atroposlib.serving.config import ServeModelConfig
    from atroposlib.serving.weights_version import write_weights_version

    url, root = server
    served = httpx.get(f"{url}/health", timeout=10).json()["version"]
    target = root / "from_trainer"
    shutil.copytree(tiny_model_dir, target)
    write_weights_version(target, served + 40)
    upd = httpx.post(f"{url}/update_weights", json={"path": str(target)}, timeout=120)
    assert upd.status_code == 200 and upd.json()["version"] == served + 40
    write_weights_version(target, 3)  # older than what is served: plain increment instead
    upd = httpx.post(f"{url}/update_weights", json={"path": str(target)}, timeout=120)
    assert upd.json()["version"] == served + 41
    state = build_state(ServeModelConfig(model=str(target), device="cpu"))
    assert state.engine.version == 3
