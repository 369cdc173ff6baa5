"""The original example trainer's functions, called with the original's arguments, on top
of this trainer (tiny model, real run-api and atropos-serve-model processes)."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from atroposlib.testing.ports import free_port
from example_trainer import api as trainer_api
from example_trainer import cli, vllm_manager
from example_trainer.checkpointing import save_checkpoint, save_lora_checkpoint
from example_trainer.config import TrainingConfig
from example_trainer.data import get_data, pad_data_to_good_offset
from example_trainer.model import load_model_and_tokenizer
from example_trainer.run import wait_for_bridge_config, wait_for_vllm
from example_trainer.trainers import (
    create_optimizer,
    create_optimizer_for_params,
    train_shared_vllm,
)
from example_trainer.training import compute_grpo_loss, run_training_step
from tests.api.conftest import TRAINER, start_api

from .conftest import make_batch


@pytest.fixture(scope="module")
def config(tiny_model_dir) -> TrainingConfig:
    return TrainingConfig(
        model_name=str(tiny_model_dir),
        device="cpu",
        optimizer="adamw",
        dtype="float32",
        gradient_accumulation_steps=2,
        batch_size=2,
        seq_len=128,
    )


def test_manual_loop_with_the_originals_functions(config, tiny_tokenizer, tmp_path):
    model, tokenizer = load_model_and_tokenizer(config)
    optimizer = create_optimizer(model, config)
    data = {"batch": make_batch(tiny_tokenizer, n_groups=1, group_size=4, with_logprobs=True)}
    tokens, labels, advantages, temperatures, logprobs = pad_data_to_good_offset(data, 2)
    assert len(tokens) == 2 and tokens[0].shape == labels[0].shape == advantages[0].shape
    assert temperatures[0].shape == (2,) and logprobs is not None
    assert pad_data_to_good_offset(data, 2, extract_inference_logprobs=False)[4] is None
    loss, metrics = compute_grpo_loss(
        model, tokens[0], labels[0], advantages[0], temperatures[0], 2, logprobs[0], 0.2
    )
    assert loss.requires_grad and loss.dim() == 0 and isinstance(metrics, dict) and metrics
    before = [p.detach().clone() for p in model.parameters()]
    out = run_training_step(
        model, optimizer, tokens, labels, advantages, temperatures, config, 0, logprobs
    )
    assert {"loss", "grad_norm", "step"} <= set(out) and out["step"] == 0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    saved = save_checkpoint(model, tokenizer, str(tmp_path), 3)
    assert isinstance(saved, str) and Path(saved, "config.json").is_file()
    assert Path(saved).name == "step_3"
    final = save_checkpoint(model, tokenizer, str(tmp_path), 4, is_final=True)
    assert Path(final).name == "final_model"
    params = create_optimizer_for_params(model.parameters(), config)
    assert isinstance(params, torch.optim.Optimizer)


def test_lora_checkpoint(config, tmp_path):
    lora = config.model_copy(update={"weight_bridge_mode": "lora_only", "lora_r": 4})
    model, _ = load_model_and_tokenizer(lora)
    path = save_lora_checkpoint(model, str(tmp_path), 2)
    assert Path(path, "adapter_config.json").is_file() and Path(path).name == "adapter_step_2"


def test_single_copy_and_shared_vllm_name_what_is_missing(config):
    with pytest.raises(ImportError, match="vLLM"):
        load_model_and_tokenizer(config, single_copy=True)
    with pytest.raises(ValueError, match="shared_vllm"):
        train_shared_vllm(config)


def test_get_data_pulls_and_pads_a_batch(tiny_tokenizer, tmp_path):
    ctx, url = start_api(tmp_path)
    with ctx:
        httpx.post(f"{url}/register", json={**TRAINER, "batch_size": 4}).raise_for_status()
        httpx.get(f"{url}/batch").raise_for_status()
        for group in make_batch(tiny_tokenizer, n_groups=1, group_size=4):
            httpx.post(f"{url}/scored_data", json=group).raise_for_status()
        batches, extra = get_data(2, 32, url, extract_inference_logprobs=False)
    assert extra is None and len(batches) == 1
    tokens, labels, advantages, temperatures, logprobs = batches[0]
    assert [t.shape[0] for t in tokens] == [2, 2] and logprobs is None
    assert all(t.shape[1] <= 32 for t in tokens)


def test_the_originals_command_line_builders(tiny_model_dir):
    parser = cli.create_base_parser("mine")
    cli.add_model_args(parser)
    cli.add_training_args(parser)
    args = parser.parse_args(["--model-name", "m", "--lr", "0.001"])
    config = cli.config_from_args(args)
    assert (config.model_name, config.lr) == ("m", 0.001)
    full = cli.parse_args(["--model-name", "m", "--lora-r", "8", "--use-wandb", "false"])
    assert cli.config_from_args(full).lora_r == 8
    flags = {a.dest for a in cli.create_full_parser()._actions}
    assert set(TrainingConfig.model_fields) <= flags
    assert {a.dest for a in cli.create_unified_parser()._actions} == flags
    for add in (
        cli.add_grpo_args,
        cli.add_vllm_args,
        cli.add_atropos_args,
        cli.add_wandb_args,
        cli.add_mode_args,
        cli.add_lora_args,
        cli.add_distributed_args,
        cli.add_debug_args,
    ):
        add(cli.create_base_parser("x"))
    assert cli.config_from_args(["--model-name", "m"]).model_name == "m"  # ours still works


def test_api_defaults_are_the_originals():
    for fn in (trainer_api.check_atropos_api, trainer_api.get_batch):
        assert inspect.signature(fn).parameters["url"].default == "http://localhost:8000"


def test_waits(tmp_path):
    path = tmp_path / "bridge.json"
    assert wait_for_bridge_config(str(path), timeout=0) is False
    path.write_text(json.dumps({"ok": 1}))
    assert wait_for_bridge_config(str(path), timeout=1) is True
    assert wait_for_vllm(free_port(), timeout=0) is False


def test_vllm_only_modules_name_the_vllm_venv_and_the_extra():
    # This venv has no vLLM (it lives in .venv-vllm): the modules say how to get it.
    for name in (
        "example_trainer.vllm_api_server",
        "example_trainer.vllm_patching.patched_gpu_runner",
    ):
        code = f"import {name}"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert proc.returncode != 0
        assert "ImportError" in proc.stderr and "vLLM" in proc.stderr
        assert "make .venv-vllm" in proc.stderr and "atroposlib[vllm]" in proc.stderr
    # ...and the package itself imports without it.
    proc = subprocess.run([sys.executable, "-c", "import example_trainer"], capture_output=True)
    assert proc.returncode == 0


def test_vllm_manager_functions_over_a_real_server(config, tiny_model_dir):
    port = free_port()
    cfg = config.model_copy(update={"vllm_port": port, "inference_backend": "serve_model"})
    assert not vllm_manager.is_port_in_use(port)
    proc = vllm_manager.launch_vllm_server(cfg, str(tiny_model_dir))
    try:
        assert proc is not None and vllm_manager.get_vllm_process() is proc
        assert vllm_manager.is_port_in_use(port)
        assert vllm_manager.check_vllm_health(port) and vllm_manager.wait_for_vllm_ready(port, 5)
        vllm_manager.check_vllm_process_health()  # alive: no error
        # atropos-serve-model has no LoRA endpoints: the swap is refused, not faked.
        assert vllm_manager.hotswap_lora_adapter("a", "/nonexistent", port) is False
        assert vllm_manager.kill_process_on_port(port, timeout=10) is True
        proc.wait(timeout=10)
        with pytest.raises(RuntimeError, match="exited"):
            vllm_manager.check_vllm_process_health()
    finally:
        vllm_manager.cleanup_vllm()
    assert vllm_manager.get_vllm_process() is None
    vllm_manager.set_vllm_process(None)
