"""``atropos-grpo-run`` with ``inference_backend: vllm`` and ``lora_only``: the environments'
rollouts are sampled through the trained adapter, against the session's real vLLM.

The launcher's environment command (its ``--openai.*`` flags, as the environments parse them
into their server config) is turned into the environments' ``ServerManager``; the trainer's
``LoraOnlySync`` loads the untrained adapter, the launcher's wait sees vLLM list it, a sync
loads trained adapter weights, and the tokens the environment samples then carry exactly
the merged model's logprobs (a transformers forward, ≤ 1e-3 in fp32), not the base model's,
and the sync's step as their policy version.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.server_handling.server_manager import ServerManager
from atroposlib.testing.vllm_server import RunningVLLM
from example_trainer.config import TrainingConfig
from example_trainer.launch.launcher import Launcher
from example_trainer.model import apply_lora
from example_trainer.run import config_from_args
from example_trainer.vllm_integration.lora import VLLM_ADAPTER_NAME, served_models, wait_for_adapter
from example_trainer.vllm_integration.weights import VLLMWeightClient
from example_trainer.weight_sync import LoraOnlySync, merged_copy

PROMPT = [11, 12, 13, 14, 15, 40, 41]


def sampled_logprobs(model: torch.nn.Module, prompt: list[int], out: list[int]) -> torch.Tensor:
    """A transformers forward's logprob of each of ``out``'s tokens after ``prompt``."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(out).view(-1, 1)).view(-1)


def environment_servers(launcher: Launcher, model: str) -> APIServerConfig:
    """The server config an environment started by ``launcher`` builds from its flags."""
    cmd = launcher.env_cmd("environments/arithmetic_server.py", model)
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    return APIServerConfig(
        base_url=flags["--openai.base_url"],
        model_name=flags["--openai.model_name"],
        server_type=flags["--openai.server_type"],
        api_key=flags["--openai.api_key"],
        tokenizer_name=flags["--env.tokenizer_name"],
        timeout=120,
    )


async def test_lora_only_rollouts_of_the_launchers_environments_come_from_the_adapter(
    vllm_server: RunningVLLM, tmp_path: Path
) -> None:
    model_dir = str(vllm_server.model_dir)
    launcher = Launcher(
        config_from_args(
            [
                "--run-dir",
                str(tmp_path / "run"),
                "--inference-backend",
                "vllm",
                "--weight-bridge-mode",
                "lora_only",
                "--inference-urls",
                vllm_server.url,
            ]
        )
    )
    env_config = environment_servers(launcher, model_dir)
    assert env_config.model_name == VLLM_ADAPTER_NAME

    client = VLLMWeightClient(vllm_server.url, 120)
    version_before = client.weight_version()
    cfg = TrainingConfig(
        model_name=model_dir,
        inference_url=launcher.inf_url,
        save_path=str(tmp_path / "ckpt"),
        sync_timeout=120,
        weight_bridge_mode="lora_only",
        lora_r=8,
        lora_alpha=16,
    )
    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    policy = apply_lora(
        AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32), cfg
    ).eval()
    sync = LoraOnlySync(cfg, policy, AutoTokenizer.from_pretrained(model_dir))
    manager = ServerManager([env_config])
    try:
        sync.start()  # the trainer loads the untrained adapter at its start
        wait_for_adapter(launcher.inf_url, timeout=60)  # what the launcher waits for
        assert {model_dir, VLLM_ADAPTER_NAME} <= set(served_models(vllm_server.url))

        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_" in name:
                    p.add_(torch.randn(p.shape, generator=gen) * 0.3)
        sync.sync(1)
        trained = merged_copy(policy).eval()

        result = await manager.tokens_and_logprobs_completion(
            input_ids=PROMPT, n=2, max_tokens=6, temperature=1.0
        )
        prompt, outs, lps, _ = result
        assert prompt == PROMPT and result.policy_version == 1
        for out, lp in zip(outs, lps, strict=True):
            served = torch.tensor(lp)
            assert (served - sampled_logprobs(trained, PROMPT, out)).abs().max() <= 1e-3
            # ... and not the base model's: the adapter moved these tokens' logprobs.
            assert (served - sampled_logprobs(base, PROMPT, out)).abs().max() > 0.05
    finally:
        await manager.close()
        httpx.post(
            f"{vllm_server.url}/v1/unload_lora_adapter",
            json={"lora_name": VLLM_ADAPTER_NAME},
            timeout=60,
        )
        if version_before is not None:
            client.set_version(version_before)
