"""Tools against a real ``run-api``: auth, reset only on request, sft-gen live, the W&B watcher."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from atroposlib.cli import inference_node_wandb_watcher as watcher_cli
from atroposlib.frontend.api_client import ApiError, TrainerClient
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import PYTHON, start_process, stop_process

KEY = "test-secret-key"  # the key of the keyed_api fixture
REGISTRATION = {
    "wandb_group": "grp",
    "wandb_project": "proj",
    "batch_size": 4,
    "max_token_len": 512,
    "checkpoint_dir": "c",
    "save_checkpoint_interval": 1,
    "starting_step": 3,
    "num_steps": 10,
}


@pytest.fixture
def api(keyed_api: str, api_key: str) -> str:
    assert api_key == KEY
    return keyed_api


@pytest.fixture
def keyed(monkeypatch):
    monkeypatch.setenv("ATROPOS_API_KEY", KEY)


def _h(api: str) -> httpx.Client:
    return httpx.Client(base_url=api, timeout=10, headers={"Authorization": f"Bearer {KEY}"})


def _group(n: int, score_hi: float = 1.0) -> dict:
    toks = [[65, 66, 67, 68 + i] for i in range(n)]
    return {
        "tokens": toks,
        "masks": [[-100, -100, -100, t[-1]] for t in toks],
        "scores": [score_hi] + [-1.0] * (n - 1),
        "messages": [
            [{"role": "user", "content": "ABC"}, {"role": "assistant", "content": chr(68 + i)}]
            for i in range(n)
        ],
    }


def test_client_without_key_gets_a_clear_401_message(api: str, monkeypatch) -> None:
    monkeypatch.delenv("ATROPOS_API_KEY", raising=False)
    with TrainerClient(api) as client:
        client.check()  # "/" needs no key
        with pytest.raises(ApiError, match="set ATROPOS_API_KEY"):
            client.status()


def test_reset_happens_only_when_asked(api: str, keyed) -> None:
    with _h(api) as h, TrainerClient(api) as client:
        h.get("/reset_data")
        h.post("/register", json=REGISTRATION).raise_for_status()
        h.post("/scored_data", json=_group(2)).raise_for_status()
        client.ensure_registered(batch_size=16, max_token_len=512, num_steps=5, reset=False)
        assert h.get("/status").json()["queue_size"] == 1
        assert h.get("/info").json()["batch_size"] == 4  # the first trainer's config stands
        client.ensure_registered(batch_size=16, max_token_len=512, num_steps=5, reset=True)
        assert h.get("/status").json()["queue_size"] == 0
        assert h.get("/info").json()["batch_size"] == 16


def test_sft_gen_live_collects_from_batches(api: str, keyed, tmp_path: Path) -> None:
    out = tmp_path / "sft.jsonl"
    with _h(api) as h:
        h.get("/reset_data")
        proc = start_process(
            [
                PYTHON,
                "-m",
                "atroposlib.cli.sft",
                str(out),
                "--api-url",
                api,
                "--save-messages",
                "--group-size",
                "2",
                "--tasks-per-step",
                "2",
                "--num-seqs-to-save",
                "2",
                "--format",
                "trl",
                "--poll-interval",
                "0.2",
                "--no-progress",
            ],
            log_path=tmp_path / "sft.log",
        )
        try:
            deadline = time.monotonic() + 60
            while h.get("/info").json()["batch_size"] != 4:
                assert proc.poll() is None, (tmp_path / "sft.log").read_text()
                assert time.monotonic() < deadline, "sft-gen never registered"
                time.sleep(0.2)
            h.post(
                "/scored_data_list", json=[_group(2), _group(2, score_hi=0.5)]
            ).raise_for_status()
            assert proc.wait(timeout=60) == 0, (tmp_path / "sft.log").read_text()
        finally:
            stop_process(proc)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert (
        rows
        == [
            {
                "messages": [
                    {"role": "user", "content": "ABC"},
                    {"role": "assistant", "content": "D"},
                ]
            }
        ]
        * 2
    )


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server API)
        self.send_response(200 if self.path == "/health_generate" else 404)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_watcher_logs_server_health_when_the_step_changes(api: str, keyed) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = server.server_address[1]
    logged: list[tuple[dict, int]] = []
    try:
        with _h(api) as h, TrainerClient(api) as client:
            h.get("/reset_data")
            h.post("/register", json=REGISTRATION).raise_for_status()
            assert watcher_cli.wait_for_wandb_info(client, timeout=5)["project"] == "proj"
            urls = watcher_cli.health_urls(tp=4, host="127.0.0.1", base_port=base, gpus_per_node=8)
            assert len(urls) == 2
            w = watcher_cli.Watcher(
                client, node_num=7, urls=urls, log=lambda m, s: logged.append((m, s))
            )
            assert w.tick() == 3  # starting_step=3 is a new step
            assert w.tick() is None  # unchanged step: nothing logged
            h.post("/scored_data_list", json=[_group(2), _group(2)]).raise_for_status()
            assert h.get("/batch").json()["batch"]
            assert w.tick() == 4
            w.http.close()
    finally:
        server.shutdown()
    health = {"server/server_health_7_0": 1.0, "server/server_health_7_1": 0.0}
    assert logged == [(health, 3), (health, 4)]


def test_watcher_cli_runs_with_wandb_disabled_and_fails_clearly_without_api(
    api: str, keyed, capsys
) -> None:
    with _h(api) as h:
        h.get("/reset_data")
        h.post("/register", json=REGISTRATION).raise_for_status()
    assert (
        watcher_cli.main(
            [
                "--api_addr",
                api,
                "--tp",
                "8",
                "--node_num",
                "0",
                "--max-iterations",
                "1",
                "--base-port",
                str(free_port()),
                "--health-host",
                "127.0.0.1",
            ]
        )
        == 0
    )
    dead = f"http://127.0.0.1:{free_port()}"
    assert (
        watcher_cli.main(
            ["--api_addr", dead, "--tp", "1", "--node_num", "0", "--wait-timeout", "0.5"]
        )
        == 1
    )
    assert "no W&B project" in capsys.readouterr().err
    assert watcher_cli.main(["--api_addr", dead, "--tp", "0", "--node_num", "0"]) == 2


def test_watcher_requires_the_original_flags(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        watcher_cli.main(["--tp", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--api_addr" in err and "--node_num" in err
