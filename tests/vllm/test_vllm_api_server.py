"""``python -m example_trainer.vllm_api_server`` on vLLM 0.32, started once for this module as a
real process (from .venv-vllm) on the head_dim-32 tiny model, with an API key."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import torch

from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.server_handling.vllm_server import VLLMServer
from atroposlib.testing.ports import start_on_free_port
from atroposlib.testing.vllm_server import VLLM_ENV
from atroposlib.utils.processes import stop_process_group

KEY = "test-key-vllm-api-server"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGINAL_ROUTES = {
    "/health",
    "/health_generate",
    "/generate",
    "/bridge/info",
    "/bridge/state_dict_info",
    "/bridge/pause",
    "/bridge/resume",
    "/bridge/is_paused",
    "/bridge/sleep",
    "/bridge/wake_up",
    "/bridge/is_sleeping",
    "/bridge/debug",
    "/bridge/list_endpoints",
    "/lora/status",
    "/lora/load",
    "/lora/unload",
}


@pytest.fixture(scope="module")
def api(vllm_python: str, vllm_model_dir: Path, tmp_path_factory) -> Iterator[httpx.Client]:
    """The server, one for the module; a client that sends the key."""
    log = tmp_path_factory.mktemp("vllm-api-server") / "server.log"
    env = {**VLLM_ENV, "ATROPOS_API_KEY": KEY}
    env.pop("VLLM_SERVER_DEV_MODE", None)

    def cmd(port: int) -> list[str]:
        return [
            vllm_python,
            "-m",
            "example_trainer.vllm_api_server",
            "--model",
            str(vllm_model_dir),
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--max-model-len",
            "512",
            "--enable-lora",
            "--max-lora-rank",
            "16",
        ]

    proc, port = start_on_free_port(cmd, log_path=log, env=env, timeout=900)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH, timeout=300) as c:
            yield c
    finally:
        stop_process_group(proc, 30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def hf_model(vllm_model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32).eval()


def rescore(model, prompt: list[int], completion: list[int]) -> list[float]:
    """The model's own log-probabilities of ``completion`` after ``prompt``."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion)]


def test_health_key_and_bounds(api: httpx.Client) -> None:
    assert httpx.get(f"{api.base_url}/health").status_code == 200  # open without the key
    assert httpx.post(f"{api.base_url}/generate", json={"prompt": "a"}).status_code == 401
    assert api.get("/health_generate").status_code == 200
    for body, param in [
        ({"prompt": "a", "temperature": -1}, "temperature"),
        ({"prompt": "a", "top_p": 1.5}, "top_p"),
        ({"prompt": "a", "logprobs": 50}, "logprobs"),
        ({"prompt": "a", "frobnicate": 1}, "frobnicate"),
        ({"prompt": {"prompt_token_ids": [5] * 600}, "max_tokens": 1}, None),  # > context
    ]:
        r = api.post("/generate", json=body)
        assert r.status_code == 400, (body, r.text)
        if param is not None:
            assert r.json()["error"]["param"] == param
    # What this start-up rules out is a 409 saying why, not a 500.
    assert api.post("/bridge/sleep").status_code == 409
    r = api.post("/start_weight_update")
    assert r.status_code == 409 and "VLLM_ENABLE_SHARED_WEIGHTS" in r.text


def test_generate_has_the_originals_shape_and_logprobs_equal_a_rescore(
    api: httpx.Client, hf_model
) -> None:
    prompt = [5, 17, 42, 9, 101]
    body = {
        "prompt": {"prompt_token_ids": prompt},
        "n": 2,
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 3,
        "logprobs": 0,
        "ignore_eos": True,
    }
    r = api.post("/generate", json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert set(answer) == {
        "text",
        "prompt",
        "finish_reasons",
        "logprobs",
        "prompt_token_ids",
        "token_ids",
    }
    assert answer["prompt_token_ids"] == prompt and answer["finish_reasons"] == ["length"] * 2
    assert isinstance(answer["prompt"], str) and len(answer["text"]) == 2
    for ids, positions in zip(answer["token_ids"], answer["logprobs"], strict=True):
        assert len(ids) == len(positions) == 6
        # [seq][pos] = [{token_id: logprob}]: one dict per position, the sampled token in it.
        assert all(len(p) == 1 and str(t) in p[0] for t, p in zip(ids, positions, strict=True))
        served = [p[0][str(t)] for t, p in zip(ids, positions, strict=True)]
        expected = rescore(hf_model, prompt, ids)
        assert max(abs(a - b) for a, b in zip(served, expected, strict=True)) <= 1e-3
    # Prompt logprobs (what VLLMServer.get_logprobs reads) are the model's too.
    r = api.post("/generate", json={**body, "n": 1, "prompt_logprobs": 1, "max_tokens": 1})
    scored = r.json()["prompt_logprobs"]
    assert scored[0] is None
    expected = rescore(hf_model, prompt[:1], prompt[1:])
    got = [scored[i][str(t)] for i, t in enumerate(prompt) if i > 0]
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) <= 1e-3
    # A text prompt comes back as given; without logprobs the answer is the three keys.
    r = api.post("/generate", json={"prompt": "Hello there", "max_tokens": 3})
    assert set(r.json()) == {"text", "prompt", "finish_reasons"}
    assert r.json()["prompt"] == "Hello there"


def test_bridge_routes(api: httpx.Client) -> None:
    info = api.get("/bridge/info").json()
    assert info["enabled"] is False and info["device"] == "cpu" and info["update_count"] == 0
    assert api.get("/bridge/state_dict_info").json()["dtype"] == "torch.float32"
    assert api.get("/bridge/debug").json()["vllm_version"].startswith("0.32")
    listed = {e["path"] for e in api.get("/bridge/list_endpoints").json()["endpoints"]}
    assert ORIGINAL_ROUTES <= listed
    assert api.get("/bridge/is_sleeping").json() == {"sleeping": False}
    assert api.post("/bridge/pause", params={"mode": "later"}).json()["error"]["param"] == "mode"
    # Paused, a request waits; after resume it is answered.
    assert api.post("/bridge/pause").json()["status"] == "paused"
    try:
        assert api.get("/bridge/is_paused").json() == {"paused": True}
        with pytest.raises(httpx.ReadTimeout):
            api.post("/generate", json={"prompt": "x", "max_tokens": 2}, timeout=3)
    finally:
        assert api.post("/bridge/resume").json() == {"status": "resumed"}
    assert api.get("/bridge/is_paused").json() == {"paused": False}
    r = api.post("/generate", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["text"]) == 1
    # vLLM's weight version, readable and settable (what http_reload stamps).
    assert api.post("/update_weight_version", json={"new_version": "4"}).status_code == 200
    assert api.get("/weight_info").json() == {"weight_version": "4"}
    r = api.post("/generate", json={"prompt": "x", "max_tokens": 1})
    assert r.headers["x-atropos-policy-version"] == "4"


async def test_the_environments_client_takes_tokens_from_its_generate(
    api: httpx.Client, vllm_model_dir: Path, hf_model
) -> None:
    """``VLLMServer`` (``server_type: vllm``) finds the original's ``/generate`` here and takes
    tokens, logprobs, prompt top-k and the weight version from it."""
    root = str(api.base_url).rstrip("/")
    assert api.post("/update_weight_version", json={"new_version": "5"}).status_code == 200
    server = VLLMServer(
        APIServerConfig(
            base_url=f"{root}/v1",
            model_name=str(vllm_model_dir),
            server_type="vllm",
            tokenizer_name=str(vllm_model_dir),
            api_key=KEY,
            timeout=120,
        )
    )
    prompt = [5, 17, 42, 9, 101]
    try:
        assert (await server.routes()).generate
        result = await server.tokens_and_logprobs_completion(
            input_ids=prompt, n=2, max_tokens=4, temperature=1.0
        )
        top = await server.get_logprobs(input_ids=prompt, top_k=2)
    finally:
        await server.close()
    _, outs, lps, finish = result
    assert len(outs) == len(finish) == 2 and result.policy_version == 5
    for ids, seq_lps in zip(outs, lps, strict=True):
        assert 1 <= len(ids) == len(seq_lps) <= 4
        expected = rescore(hf_model, prompt, ids)
        assert max(abs(a - b) for a, b in zip(seq_lps, expected, strict=True)) <= 1e-3
    # The model's own 2 best tokens at each position after the first.
    with torch.no_grad():
        logp = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    best = logp[:-1].topk(2)
    assert top["prompt_topk_token_ids"][1:] == best.indices.tolist()
    got = torch.tensor(top["prompt_topk_logprobs"][1:])
    assert (got - best.values).abs().max().item() <= 1e-3


def make_adapter(model_dir: Path, out: Path) -> Path:
    """A PEFT LoRA adapter with non-zero weights (a fresh one would change nothing)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(out)
    return out


def test_lora_load_serves_the_adapter_and_unload_restores(
    api: httpx.Client, vllm_model_dir: Path, tmp_path: Path
) -> None:
    prompt = {"prompt_token_ids": [5, 17, 42, 9]}
    body = {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0}

    def scores() -> list:
        r = api.post("/generate", json=body)
        assert r.status_code == 200, r.text
        return r.json()["prompt_logprobs"]

    base = scores()
    adapter = make_adapter(vllm_model_dir, tmp_path / "adapter")
    assert api.get("/lora/status").json()["lora_available"] is True
    r = api.post("/lora/load", json={"adapter_path": str(adapter), "adapter_name": "a1"})
    assert r.status_code == 200, r.text
    assert r.json()["adapter_id"] == 1 and r.json()["adapter_config"]["r"] == 8
    status = api.get("/lora/status").json()
    assert status["active_adapter_name"] == "a1" and status["load_count"] == 1
    with_adapter = scores()
    assert with_adapter != base
    # A missing or broken adapter is refused, naming the field; the loaded one keeps serving.
    r = api.post("/lora/load", json={"adapter_path": str(tmp_path / "nope")})
    assert r.status_code == 404 and r.json()["error"]["param"] == "adapter_path"
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"r": 8}))
    r = api.post("/lora/load", json={"adapter_path": str(broken)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "adapter_path"
    assert api.get("/lora/status").json()["active_adapter_name"] == "a1"
    assert scores() == with_adapter
    r = api.post("/lora/unload").json()
    assert r["previous_name"] == "a1"
    assert api.get("/lora/status").json()["active_adapter_path"] is None
    assert scores() == base


def test_shared_weights_mode_refuses_without_cuda(vllm_python: str, vllm_model_dir: Path) -> None:
    env = {**os.environ, "VLLM_ENABLE_SHARED_WEIGHTS": "1"}
    proc = subprocess.run(
        [vllm_python, "-m", "example_trainer.vllm_api_server", "--model", str(vllm_model_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "CUDA" in lines[0] and "http_reload" in lines[0]
