"""Weight sync and API client failure paths: clear errors, bounded waits, never a hang."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Dict, Tuple

import pytest
import torch

from atroposlib.testing.ports import free_port
from example_trainer import api
from example_trainer.config import TrainingConfig
from example_trainer.model import setup_model
from example_trainer.weight_sync import HttpReloadSync, LoraOnlySync, WeightSyncError, merged_copy

Handler = Callable[[str, str, bytes], Tuple[int, Dict]]


class _Server:
    """A loopback HTTP server whose answers come from a function (unit-test double)."""

    def __init__(self, handler: Handler) -> None:
        outer = self
        self.requests: list = []

        class H(BaseHTTPRequestHandler):
            def _do(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                outer.requests.append((self.command, self.path, body, dict(self.headers)))
                status, payload = handler(self.command, self.path, body)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _do

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake_server():
    servers = []

    def make(handler: Handler) -> _Server:
        s = _Server(handler)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


@pytest.fixture(scope="module")
def tiny(tiny_model_dir, tmp_path_factory):
    cfg = TrainingConfig(
        model_name=str(tiny_model_dir),
        device="cpu",
        progress=False,
        save_path=str(tmp_path_factory.mktemp("ckpt")),
    )
    model, tok = setup_model(cfg)
    return cfg, model, tok


def _cfg(base: TrainingConfig, **kw) -> TrainingConfig:
    return base.model_copy(update=kw)


def test_http_reload_posts_saved_weights_dir_and_tracks_version(fake_server, tiny):
    cfg, model, tok = tiny
    versions = iter(range(1, 10))
    srv = fake_server(
        lambda m, p, b: (200, {"status": "ok"} if p == "/health" else {"version": next(versions)})
    )
    sync = HttpReloadSync(
        _cfg(cfg, inference_url=srv.url, weight_bridge_mode="http_reload"), model, tok
    )
    sync.start()
    sync.sync(1)
    sync.sync(2)
    posted = [json.loads(b)["path"] for m, p, b, _ in srv.requests if p == "/update_weights"]
    assert len(posted) == 2 and posted[1].endswith("step_2")
    assert sync.last_version == 2
    from pathlib import Path

    assert (Path(posted[1]) / "config.json").exists() and not Path(
        posted[0]
    ).exists()  # old dir cleaned


def test_http_reload_fails_when_version_does_not_advance(fake_server, tiny):
    cfg, model, tok = tiny
    srv = fake_server(lambda m, p, b: (200, {"version": 3}))
    sync = HttpReloadSync(_cfg(cfg, inference_url=srv.url), model, tok)
    sync.sync(1)
    with pytest.raises(WeightSyncError, match="did not advance"):
        sync.sync(2)


def test_http_reload_times_out_instead_of_hanging(fake_server, tiny):
    cfg, model, tok = tiny

    release = threading.Event()

    def slow(m, p, b):
        release.wait(60)  # answers only once the test has seen the outcome (a hang guard)
        return 200, {"version": 1}

    srv = fake_server(slow)
    sync = HttpReloadSync(_cfg(cfg, inference_url=srv.url, sync_timeout=0.5), model, tok)
    try:
        with pytest.raises(WeightSyncError, match="timed out"):
            sync.sync(1)  # without a timeout this would wait for the answer and succeed
    finally:
        release.set()


def test_http_reload_reports_unreachable_server_and_error_status(fake_server, tiny):
    cfg, model, tok = tiny
    sync = HttpReloadSync(
        _cfg(cfg, inference_url=f"http://127.0.0.1:{free_port()}", sync_timeout=2), model, tok
    )
    with pytest.raises(WeightSyncError, match="not reachable"):
        sync.start()
    srv = fake_server(lambda m, p, b: (400, {"error": {"message": "bad path"}}))
    sync = HttpReloadSync(_cfg(cfg, inference_url=srv.url), model, tok)
    with pytest.raises(WeightSyncError, match="400"):
        sync.sync(1)


def test_lora_only_falls_back_to_update_weights_without_lora_endpoint(
    fake_server, tiny_model_dir, tmp_path
):
    cfg = TrainingConfig(
        model_name=str(tiny_model_dir),
        device="cpu",
        progress=False,
        save_path=str(tmp_path),
        weight_bridge_mode="lora_only",
        lora_r=4,
        lora_alpha=8,
    )
    model, tok = setup_model(cfg)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    srv = fake_server(lambda m, p, b: (404, {}) if p == "/lora/load" else (200, {"version": 1}))
    sync = LoraOnlySync(cfg.model_copy(update={"inference_url": srv.url}), model, tok)
    sync.sync(1)
    assert (tmp_path / "adapter_step_1" / "adapter_config.json").exists()
    paths = [p for _, p, _, _ in srv.requests]
    assert paths == ["/lora/load", "/update_weights"]
    merged = merged_copy(model)
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    assert any(
        "lora_" in n for n, _ in model.named_parameters()
    )  # the trained model keeps its adapter


def test_get_batch_raises_on_error_payload_and_returns_none_when_empty(fake_server):
    srv = fake_server(
        lambda m, p, b: (
            200,
            {"status": "error", "message": "Trainer not registered.", "batch": []},
        )
    )
    with pytest.raises(api.AtroposAPIError, match="not registered"):
        api.get_batch(srv.url)
    srv2 = fake_server(lambda m, p, b: (200, {"batch": None}))
    assert api.get_batch(srv2.url) is None


def test_api_key_is_sent_and_401_explained(fake_server, monkeypatch):
    srv = fake_server(lambda m, p, b: (401, {"detail": "unauthorized"}))
    monkeypatch.setenv("ATROPOS_API_KEY", "sekret")
    with pytest.raises(api.AtroposAPIError, match="ATROPOS_API_KEY"):
        api.get_batch(srv.url)
    assert srv.requests[0][3].get("Authorization") == "Bearer sekret"


def test_register_sends_original_payload_and_requires_uuid(fake_server, monkeypatch):
    srv = fake_server(lambda m, p, b: (200, {"uuid": 42}))
    cfg = TrainingConfig(
        model_name="m",
        atropos_url=srv.url,
        batch_size=4,
        gradient_accumulation_steps=8,
        seq_len=512,
        training_steps=7,
        checkpoint_interval=0,
        wandb_project=None,
    )
    assert api.register_trainer(cfg, starting_step=3)["uuid"] == 42
    body = json.loads(srv.requests[0][2])
    assert body == {
        "wandb_group": cfg.wandb_group,
        "wandb_project": "",
        "batch_size": 32,
        "max_token_len": 512,
        "checkpoint_dir": cfg.save_path,
        "save_checkpoint_interval": 7,
        "starting_step": 3,
        "num_steps": 7,
    }


def test_check_api_gives_up_after_timeout(monkeypatch):
    class FakeClock:
        """``time`` as the API client sees it: sleeping advances the clock at once."""

        now = 0.0
        sleeps: list = []

        @classmethod
        def monotonic(cls) -> float:
            return cls.now

        @classmethod
        def sleep(cls, seconds: float) -> None:
            cls.sleeps.append(seconds)
            cls.now += seconds

    monkeypatch.setattr(api, "time", FakeClock)
    with pytest.raises(api.AtroposAPIError, match="not reachable after 1s"):
        api.check_atropos_api(f"http://127.0.0.1:{free_port()}", timeout=1.0, interval=0.25)
    assert FakeClock.sleeps == [0.25] * 4  # polled at 0, 0.25, 0.5, 0.75 and 1.0, then gave up


def test_wait_for_batch_times_out(fake_server):
    srv = fake_server(lambda m, p, b: (200, {"batch": None}))
    with pytest.raises(api.AtroposAPIError, match="no batch"):
        api.wait_for_batch(srv.url, poll_interval=0.05, timeout=0.3)


def test_layer_selection_freezes_other_layers(tiny_model_dir, tmp_path):
    cfg = TrainingConfig(
        model_name=str(tiny_model_dir),
        device="cpu",
        progress=False,
        save_path=str(tmp_path),
        train_layer_indices=[1],
    )
    model, _ = setup_model(cfg)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all(".layers.1." in n for n in names)
    assert torch.is_tensor(next(model.parameters()))


def test_restart_mode_refuses_busy_port_with_clear_error(fake_server, tiny, tmp_path):
    from example_trainer.weight_sync import RestartSync

    cfg, model, tok = tiny
    srv = fake_server(lambda m, p, b: (200, {}))
    port = int(srv.url.rsplit(":", 1)[1])
    sync = RestartSync(
        _cfg(
            cfg,
            vllm_port=port,
            weight_bridge_mode="none",
            inference_backend="serve_model",
            save_path=str(tmp_path),
        ),
        model,
        tok,
    )
    with pytest.raises(WeightSyncError, match="already in use"):
        sync.start()
    sync.close()


def test_server_commands_for_both_backends(monkeypatch):
    from example_trainer.vllm_manager import server_command

    # The vLLM command is built without vLLM installed: only its interpreter is named.
    monkeypatch.setenv("ATROPOS_VLLM_PYTHON", "/opt/vllm/bin/python")

    sm = server_command("serve_model", "/m", 9100, served_model_name="name")
    assert sm[1:4] == ["-m", "atroposlib.cli.serve_model", "/m"] and sm[-2:] == [
        "--served-model-name",
        "name",
    ]
    vl = server_command("vllm", "/m", 9100, gpu_memory_utilization=0.3)
    assert vl[0] == "/opt/vllm/bin/python" and (
        "vllm.entrypoints.openai.api_server" in vl
        and vl[vl.index("--gpu-memory-utilization") + 1] == "0.3"
    )


def test_linear_warmup_schedule():
    from example_trainer.model import build_scheduler

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(opt, warmup_steps=4)
    lrs = []
    for _ in range(6):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


def test_restart_mode_restarts_a_real_server_on_new_weights(tiny, tmp_path):
    import httpx

    from example_trainer.weight_sync import RestartSync

    cfg, model, tok = tiny
    port = free_port()
    sync = RestartSync(
        _cfg(
            cfg,
            vllm_port=port,
            weight_bridge_mode="none",
            inference_backend="serve_model",
            save_path=str(tmp_path),
            sync_timeout=120,
            vllm_restart_interval=1,
        ),
        model,
        tok,
    )
    try:
        sync.start()
        first_pid = sync.server.proc.pid
        sync.sync(1)
        assert sync.server.proc.pid != first_pid and sync.syncs == 1
        assert (tmp_path / "served_weights" / "step_1" / "config.json").exists()
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    finally:
        sync.close()
    assert sync.server.proc is None


def test_lora_restart_serves_the_merged_adapter_from_a_restarted_server(tiny_model_dir, tmp_path):
    import httpx
    from safetensors import safe_open

    from example_trainer.weight_sync import RestartSync, make_weight_sync

    port = free_port()
    cfg = TrainingConfig(
        model_name=str(tiny_model_dir),
        device="cpu",
        progress=False,
        save_path=str(tmp_path),
        weight_bridge_mode="lora_restart",
        lora_r=4,
        lora_alpha=8,
        vllm_port=port,
        inference_backend="serve_model",
        sync_timeout=120,
        vllm_restart_interval=1,
    )
    model, tok = setup_model(cfg)
    with torch.no_grad():  # a trained adapter: make the merged weights differ from the base
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.fill_(0.01)
    sync = make_weight_sync(cfg, model, tok)
    assert isinstance(sync, RestartSync)
    try:
        sync.start()
        first_pid = sync.server.proc.pid
        sync.sync(1)
        assert sync.server.proc.pid != first_pid
        served = tmp_path / "served_weights" / "step_1"
        assert not (served / "adapter_config.json").exists()
        with safe_open(str(served / "model.safetensors"), "pt") as f:
            keys = list(f.keys())
            assert keys and not any("lora_" in k for k in keys)
            merged = merged_copy(model).state_dict()
            key = next(k for k in keys if k.endswith("q_proj.weight"))
            assert torch.allclose(f.get_tensor(key), merged[key])
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10)
        assert models.status_code == 200
    finally:
        sync.close()
    assert sync.server.proc is None
