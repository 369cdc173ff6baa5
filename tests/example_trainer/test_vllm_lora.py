"""``atropos-grpo-run`` with the policy served as vLLM LoRA adapter (``lora_only``): what the
launcher hands vLLM, the environments and the eval function, and its wait for the adapter.

The run against a real vLLM is ``tests/vllm/test_lora_rollouts_vllm.py``; here a small
loopback HTTP server stands in for vLLM's ``/v1/models`` and ``/v1/completions``.
"""

from __future__ import annotations

import inspect
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any, Iterator, List

import pytest

from example_trainer.launch.evaluation import Evaluator
from example_trainer.launch.launcher import Launcher
from example_trainer.launch.run_config import EvalSection
from example_trainer.run import config_from_args
from example_trainer.vllm_integration.lora import (
    VLLM_ADAPTER_NAME,
    AdapterWaitError,
    lora_server_args,
    max_lora_rank,
    wait_for_adapter,
)


def launcher(tmp_path, *argv: str) -> Launcher:
    return Launcher(
        config_from_args(["--run-dir", str(tmp_path / "run"), "--inference-port", "9123", *argv])
    )


def env_flags(cmd: List[str]) -> dict:
    return dict(zip(cmd[3::2], cmd[4::2], strict=False))


@pytest.mark.parametrize(
    "backend, mode, wanted",
    [
        ("vllm", "lora_only", VLLM_ADAPTER_NAME),
        # lora_restart restarts vLLM on the merged model under the base name.
        ("vllm", "lora_restart", "/m"),
        ("vllm", "http_reload", "/m"),
        # atropos-serve-model merges the adapter into its weights.
        ("serve_model", "lora_only", "/m"),
    ],
)
def test_environments_request_the_adapter_only_when_vllm_serves_it(
    tmp_path, monkeypatch, backend, mode, wanted
) -> None:
    monkeypatch.setenv("ATROPOS_VLLM_PYTHON", "/opt/vllm/bin/python")
    run = launcher(tmp_path, "--inference-backend", backend, "--weight-bridge-mode", mode)
    flags = env_flags(run.env_cmd("e.py", "/m"))
    assert flags["--openai.model_name"] == wanted
    assert flags["--env.tokenizer_name"] == "/m"  # the tokenizer stays the base model's
    assert flags["--openai.base_url"] == "http://127.0.0.1:9123/v1"
    cmd, env = run.inference_cmd("/m")
    if wanted == VLLM_ADAPTER_NAME:
        # vLLM is started able to serve the trainer's adapter (default lora_r 16).
        assert cmd[cmd.index("--enable-lora") :][:3] == ["--enable-lora", "--max-lora-rank", "16"]
        assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    else:
        assert "--enable-lora" not in cmd


def test_vllm_lora_rank_follows_the_trainer_and_the_runs_own_flags_win(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("ATROPOS_VLLM_PYTHON", "/opt/vllm/bin/python")
    base = ["--inference-backend", "vllm", "--weight-bridge-mode", "lora_only"]
    run = launcher(tmp_path, *base)
    run.config.trainer["lora_r"] = 40
    cmd, _ = run.inference_cmd("/m")
    assert cmd[cmd.index("--max-lora-rank") + 1] == "64"
    run.config.inference_args[:] = ["--enable-lora", "--max-lora-rank", "128"]
    cmd, _ = run.inference_cmd("/m")
    assert cmd.count("--enable-lora") == 1 and cmd[-1] == "128"
    assert [max_lora_rank(r) for r in (1, 2, 8, 9, 320, 512)] == [1, 8, 8, 16, 320, 512]
    with pytest.raises(ValueError, match="lora_r 600"):
        lora_server_args(600)


class FakeVLLM:
    """``GET /v1/models`` (the adapter listed from the ``appear_after``-th call on) and
    ``POST /v1/completions`` (bodies kept) on a loopback port."""

    def __init__(self, appear_after: int = 1) -> None:
        self.appear_after = appear_after
        self.model_calls = 0
        self.bodies: List[dict] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                fake.model_calls += 1
                ids = ["/m"] + (
                    [VLLM_ADAPTER_NAME] if fake.model_calls >= fake.appear_after else []
                )
                self._send({"object": "list", "data": [{"id": i} for i in ids]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.bodies.append(body)
                n = len(body["prompt"]) * body.get("n", 1)
                self._send({"choices": [{"index": i, "text": ""} for i in range(n)]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake_vllm() -> Iterator[FakeVLLM]:
    server = FakeVLLM(appear_after=3)
    yield server
    server.close()


def test_wait_for_adapter_returns_once_vllm_lists_it(fake_vllm: FakeVLLM) -> None:
    wait_for_adapter(fake_vllm.url, timeout=30, interval=0.01)
    assert fake_vllm.model_calls == 3


def test_wait_for_adapter_stops_at_once_when_the_trainer_dies(fake_vllm: FakeVLLM) -> None:
    with pytest.raises(AdapterWaitError, match="trainer exited.*exit code 1: no peft"):
        wait_for_adapter(fake_vllm.url, 30, lambda: "exit code 1: no peft", interval=0.01)
    assert fake_vllm.model_calls == 1


def test_wait_for_adapter_times_out_naming_what_vllm_serves(fake_vllm: FakeVLLM) -> None:
    fake_vllm.appear_after = 10**6
    with pytest.raises(AdapterWaitError, match=r"within 0s \(it serves \['/m'\]\)"):
        wait_for_adapter(fake_vllm.url, 0.05, interval=0.01)


def test_eval_requests_the_served_adapter_when_its_function_takes_a_model(
    fake_vllm: FakeVLLM, tiny_model_dir, monkeypatch
) -> None:
    """The arithmetic eval (greedy_eval) asks vLLM for the adapter once the launcher says the
    policy is served as one; before that, and for a function without ``model``, the
    server's default."""
    ev = Evaluator(
        EvalSection(function="environments/arithmetic_server.py:greedy_eval"), fake_vllm.url
    )
    ev.evaluate("before", 0, str(tiny_model_dir))
    assert "model" not in fake_vllm.bodies[-1]
    ev.served_model = VLLM_ADAPTER_NAME
    ev.evaluate("after", 1, str(tiny_model_dir))
    assert fake_vllm.bodies[-1]["model"] == VLLM_ADAPTER_NAME
    calls: List[str] = []

    def no_model(base_url: str, tokenizer: Any) -> float:
        calls.append(base_url)
        return 0.5

    monkeypatch.setattr("example_trainer.launch.evaluation.load_function", lambda spec: no_model)
    assert ev.evaluate("during", 2, str(tiny_model_dir)) == 0.5
    assert calls == [fake_vllm.url]


def test_launcher_waits_for_the_adapter_before_the_environments_then_evals_it(
    tmp_path, fake_vllm: FakeVLLM
) -> None:
    """``run`` calls this between starting the trainer and the environments."""
    trainer = SimpleNamespace(returncode=lambda: None, log_tail=lambda: "")
    plain = launcher(tmp_path, "--inference-urls", fake_vllm.url)
    plain.procs.children["trainer"] = trainer
    plain.wait_for_policy_adapter()  # http_reload: nothing to wait for
    assert fake_vllm.model_calls == 0 and plain.evaluator.served_model is None
    lora = launcher(
        tmp_path,
        "--inference-backend",
        "vllm",
        "--weight-bridge-mode",
        "lora_only",
        "--inference-urls",
        fake_vllm.url,
    )
    lora.procs.children["trainer"] = trainer
    lora.wait_for_policy_adapter()
    assert fake_vllm.model_calls == 3 and lora.evaluator.served_model == VLLM_ADAPTER_NAME
    source = inspect.getsource(Launcher.run)
    assert source.index("wait_for_policy_adapter()") < source.index("self.env_cmd(")
