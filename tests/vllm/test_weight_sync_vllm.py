"""The trainer's weight sync into vLLM's own server (``http_reload`` and ``lora_only``).

Against the session's real vLLM: after a sync vLLM scores tokens as the saved weights do
(its prompt logprobs against a plain transformers forward of them), ``/weight_info`` and the
environments' rollouts (``VLLMServer``) carry the trainer step as the version, a directory vLLM
cannot take is refused with the old weights still serving, and a LoRA adapter is loaded and
swapped in place through ``/v1/load_lora_adapter``. Every test puts the base weights and the
version back (the server is shared).
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.server_handling.vllm_server import VLLMServer
from atroposlib.testing.vllm_server import RunningVLLM
from example_trainer.config import TrainingConfig
from example_trainer.model import apply_lora
from example_trainer.vllm_integration.weights import (
    VLLMWeightClient,
    VLLMWeightError,
    write_tied_lm_head,
)
from example_trainer.weight_sync import (
    VLLM_ADAPTER_NAME,
    HttpReloadSync,
    LoraOnlySync,
    WeightSyncError,
    merged_copy,
)

IDS = [11, 12, 13, 14, 15, 40, 41, 42, 43, 44, 45, 46]


def logprobs_vllm(server: RunningVLLM, model: str | None = None) -> torch.Tensor:
    """vLLM's logprob of each token of ``IDS`` after the ones before it (prompt logprobs)."""
    body = {
        "model": model or server.model_name,
        "prompt": IDS,
        "max_tokens": 1,
        "prompt_logprobs": 0,
        "temperature": 0.0,
    }
    resp = httpx.post(f"{server.base_url}/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    rows = resp.json()["choices"][0]["prompt_logprobs"][1:]
    return torch.tensor([row[str(t)]["logprob"] for t, row in zip(IDS[1:], rows, strict=True)])


def logprobs_hf(model: torch.nn.Module) -> torch.Tensor:
    """The same logprobs from a plain transformers forward of the trainer's weights."""
    with torch.no_grad():
        logits = model(torch.tensor([IDS])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(IDS[1:]).view(-1, 1)).view(-1)


def assert_serves(got: torch.Tensor, want: torch.Tensor) -> None:
    assert (got - want).abs().max().item() <= 1e-3, (got, want)


def assert_differs(a: torch.Tensor, b: torch.Tensor) -> None:
    assert (a - b).abs().max().item() > 0.05, (a, b)


def weight_version(server: RunningVLLM) -> str:
    return httpx.get(f"{server.url}/weight_info", timeout=30).json()["weight_version"]


def perturbed_model(model_dir: Path, seed: int) -> torch.nn.Module:
    """The served model with every weight moved by seeded noise (a trainer's new weights)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5 * (p.std() + 1e-3))
    return model.eval()


def trainer_config(server: RunningVLLM, tmp_path: Path, **kw) -> TrainingConfig:
    return TrainingConfig(
        model_name=str(server.model_dir),
        inference_url=server.url,
        save_path=str(tmp_path / "ckpt"),
        sync_timeout=120,
        **kw,
    )


@pytest.fixture
def restore_base(vllm_server: RunningVLLM, tmp_path: Path):
    """Puts the base weights and the version back after the test (from a copy with the tied
    head written out, see ``write_tied_lm_head``)."""
    before = weight_version(vllm_server)
    base = shutil.copytree(vllm_server.model_dir, tmp_path / "base-copy")
    write_tied_lm_head(base)
    yield
    VLLMWeightClient(vllm_server.url, 120).reload(base, before, check=False)


def test_reload_serves_a_tied_head_model_only_with_the_head_written_out(
    vllm_server: RunningVLLM, tmp_path: Path, restore_base
) -> None:
    """vLLM 0.32's in-place reload leaves a tied output head at its old weights; the
    trainer's directories carry the head explicitly, and then vLLM serves the new weights."""
    model = perturbed_model(vllm_server.model_dir, seed=5)
    assert model.config.tie_word_embeddings
    plain = tmp_path / "plain"
    model.save_pretrained(plain)
    client = VLLMWeightClient(vllm_server.url, 120, good_dir=vllm_server.model_dir)
    client.reload(plain, 11)
    assert (logprobs_vllm(vllm_server) - logprobs_hf(model)).abs().max().item() > 0.01
    assert write_tied_lm_head(plain) and not write_tied_lm_head(plain)
    client.reload(plain, 12)  # the check takes the explicit head as no difference
    assert_serves(logprobs_vllm(vllm_server), logprobs_hf(model))


async def test_http_reload_serves_the_trainers_weights_as_its_step(
    vllm_server: RunningVLLM, tmp_path: Path, restore_base
) -> None:
    base_out = logprobs_vllm(vllm_server)
    model = perturbed_model(vllm_server.model_dir, seed=1)
    tok = AutoTokenizer.from_pretrained(vllm_server.model_dir)
    sync = HttpReloadSync(trainer_config(vllm_server, tmp_path), model, tok)
    sync.start()
    assert sync.vllm is not None  # found out it is vLLM's own server, not atropos-serve-model
    sync.sync(3)
    new_out = logprobs_vllm(vllm_server)
    assert_serves(new_out, logprobs_hf(model))
    assert_differs(new_out, base_out)
    assert weight_version(vllm_server) == "3"
    assert httpx.get(f"{vllm_server.url}/is_paused").json()["is_paused"] is False

    # The environments' client reads the version from vLLM: rollouts carry step 3.
    client = VLLMServer(
        APIServerConfig(
            base_url=vllm_server.base_url,
            model_name=vllm_server.model_name,
            server_type="vllm",
            tokenizer_name=vllm_server.model_name,
            timeout=120,
        )
    )
    try:
        result = await client.tokens_and_logprobs_completion(input_ids=IDS[:5], max_tokens=2)
    finally:
        await client.close()
    assert result.policy_version == 3

    # A second step replaces the first (and its saved directory).
    model2 = perturbed_model(vllm_server.model_dir, seed=2)
    sync.model = model2
    sync.sync(4)
    assert_serves(logprobs_vllm(vllm_server), logprobs_hf(model2))
    assert weight_version(vllm_server) == "4"
    assert sorted(p.name for p in sync.live_root.iterdir()) == ["step_4"]
    assert sync.syncs == 2


def test_a_request_in_flight_at_a_reload_finishes_on_the_old_weights(
    vllm_server: RunningVLLM, tmp_path: Path, restore_base
) -> None:
    """The reload waits for the running request (``/pause?mode=wait``) and swaps the weights
    before anything else is served: a sequence being generated when the reload starts is
    neither cut off nor finished on the new weights."""
    model = perturbed_model(vllm_server.model_dir, seed=6)
    new_dir = tmp_path / "new"
    model.save_pretrained(new_dir)
    write_tied_lm_head(new_dir)
    client = VLLMWeightClient(vllm_server.url, 120, good_dir=vllm_server.model_dir)
    body = {
        "model": vllm_server.model_name,
        "prompt": IDS,
        "max_tokens": 400,
        "temperature": 1.0,
        "ignore_eos": True,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "stream": True,
    }
    ids: list[int] = []
    served: list[float] = []
    finish = None
    reloader = threading.Thread(target=client.reload, args=(new_dir, 21))
    with httpx.stream("POST", f"{vllm_server.base_url}/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[len("data: ") :])["choices"][0]
            lps = choice.get("logprobs") or {}
            ids += [int(t.split(":", 1)[1]) for t in lps.get("tokens") or []]
            served += lps.get("token_logprobs") or []
            finish = choice.get("finish_reason") or finish
            if ids and reloader.ident is None:
                reloader.start()  # the request is running: reload now
    reloader.join(timeout=300)
    assert client.reloads == 1 and weight_version(vllm_server) == "21"
    assert finish == "length" and len(ids) == len(served) == 400
    base = AutoModelForCausalLM.from_pretrained(vllm_server.model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = base(torch.tensor([IDS + ids])).logits[0, len(IDS) - 1 : -1].float()
    old = logits.log_softmax(-1).gather(1, torch.tensor(ids).view(-1, 1)).view(-1)
    assert_serves(torch.tensor(served), old)
    assert_serves(logprobs_vllm(vllm_server), logprobs_hf(model))  # then the new weights


def _broken_copy(src: Path, dst: Path, how: str) -> Path:
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    if how == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    else:  # a reshaped tensor: readable, but not this model's
        sd = load_file(str(weights))
        name = next(k for k in sd if k.endswith("q_proj.weight"))
        sd[name] = torch.zeros(3, 3)
        save_file(sd, str(weights), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("how", ["truncated", "reshaped"])
def test_a_load_vllm_cannot_take_leaves_the_old_weights_serving(
    vllm_server: RunningVLLM, tmp_path: Path, how: str, restore_base
) -> None:
    version = weight_version(vllm_server)
    before = logprobs_vllm(vllm_server)
    client = VLLMWeightClient(vllm_server.url, 120, good_dir=vllm_server.model_dir)
    bad = _broken_copy(vllm_server.model_dir, tmp_path / "bad", how)
    with pytest.raises(VLLMWeightError, match="bad"):
        client.reload(bad, 9)
    assert client.failures == 1 and client.reloads == 0
    assert weight_version(vllm_server) == version
    assert httpx.get(f"{vllm_server.url}/is_paused").json()["is_paused"] is False
    assert_serves(logprobs_vllm(vllm_server), before)


def test_trainer_sync_failure_is_raised_and_old_weights_serve(
    vllm_server: RunningVLLM, tmp_path: Path, monkeypatch, restore_base
) -> None:
    version = weight_version(vllm_server)
    before = logprobs_vllm(vllm_server)
    model = perturbed_model(vllm_server.model_dir, seed=3)
    tok = AutoTokenizer.from_pretrained(vllm_server.model_dir)
    sync = HttpReloadSync(trainer_config(vllm_server, tmp_path), model, tok)
    sync.start()
    import example_trainer.weight_sync as ws

    save = ws.save_model_dir

    def half_written(model, tokenizer, target, state_dict=None):
        out = save(model, tokenizer, target, state_dict)
        f = Path(out) / "model.safetensors"
        f.write_bytes(f.read_bytes()[:1000])
        return out

    monkeypatch.setattr(ws, "save_model_dir", half_written)
    with pytest.raises(WeightSyncError, match="still serves the previous"):
        sync.sync(5)
    assert sync.syncs == 0 and sync.vllm.failures == 1
    assert weight_version(vllm_server) == version
    assert_serves(logprobs_vllm(vllm_server), before)


def test_lora_only_loads_and_swaps_the_adapter_in_vllm(
    vllm_server: RunningVLLM, tmp_path: Path, restore_base
) -> None:
    base_out = logprobs_vllm(vllm_server)
    cfg = trainer_config(
        vllm_server, tmp_path, weight_bridge_mode="lora_only", lora_r=8, lora_alpha=16
    )
    base = AutoModelForCausalLM.from_pretrained(vllm_server.model_dir, torch_dtype=torch.float32)
    model = apply_lora(base, cfg).eval()
    tok = AutoTokenizer.from_pretrained(vllm_server.model_dir)
    sync = LoraOnlySync(cfg, model, tok)
    try:
        sync.start()  # the untrained adapter (B = 0): the base model's output under its name
        assert_serves(logprobs_vllm(vllm_server, VLLM_ADAPTER_NAME), base_out)
        gen = torch.Generator().manual_seed(4)
        for step in (1, 2):
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "lora_" in name:
                        p.add_(torch.randn(p.shape, generator=gen) * 0.3)
            sync.sync(step)
            want = logprobs_hf(merged_copy(model))
            assert_serves(logprobs_vllm(vllm_server, VLLM_ADAPTER_NAME), want)
            assert weight_version(vllm_server) == str(step)
        assert_differs(want, base_out)
        assert_serves(logprobs_vllm(vllm_server), base_out)  # the base model is untouched
    finally:
        httpx.post(
            f"{vllm_server.url}/v1/unload_lora_adapter",
            json={"lora_name": VLLM_ADAPTER_NAME},
            timeout=60,
        )
