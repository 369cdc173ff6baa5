"""Serving the trained LoRA adapter from vLLM's own server in an ``atropos-grpo-run`` job.

With ``inference_backend: vllm`` and ``weight_bridge_mode: lora_only`` the trainer loads its
adapter into vLLM under :data:`VLLM_ADAPTER_NAME` (``POST /v1/load_lora_adapter``) and swaps
it in place at every sync; vLLM keeps serving the base model under its own name. Sampling
the policy therefore means requesting the adapter's name, and the launcher arranges it:

- vLLM starts with LoRA enabled (:func:`lora_server_args`: ``--enable-lora`` and the least
  ``--max-lora-rank`` vLLM accepts that holds the trainer's ``lora_r``), unless the run's
  ``inference_args`` already say ``--enable-lora``;
- the environments (and the eval function, when it takes a ``model`` argument) request
  :data:`VLLM_ADAPTER_NAME` (:func:`policy_model_name`);
- the environments start only once the adapter is served (:func:`wait_for_adapter`): the
  trainer loads the untrained adapter at its start (LoRA's B matrices start at zero, so it
  answers as the base model does, under the adapter's name), so the name the environments
  request exists from their first rollout and every rollout is sampled through the adapter.

``lora_restart`` (and ``none``) restart vLLM on the merged model under the base name: the
environments keep requesting that name. ``atropos-serve-model`` merges adapters into its
weights (``/update_weights``), so it too is asked for the base name.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import httpx

from example_trainer.config_groups import LoraOptions

VLLM_ADAPTER_NAME = "policy-lora"
"""The model name the trained adapter is served under by vLLM's own server (``lora_only``)."""

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 accepts for ``--max-lora-rank``."""

DEFAULT_LORA_R: int = LoraOptions.model_fields["lora_r"].default
"""The trainer's default ``lora_r`` (read from its config model, so the two cannot drift)."""


class AdapterWaitError(RuntimeError):
    """The adapter did not appear in vLLM's model list in time, or the trainer died first."""


def serves_adapter(inference_backend: str, weight_bridge_mode: str) -> bool:
    """Whether the policy is served as a LoRA adapter under :data:`VLLM_ADAPTER_NAME`."""
    return inference_backend == "vllm" and weight_bridge_mode == "lora_only"


def policy_model_name(inference_backend: str, weight_bridge_mode: str, base_name: str) -> str:
    """The model name that samples the policy being trained: the adapter's name when vLLM
    serves it as an adapter, else ``base_name`` (the served model)."""
    return VLLM_ADAPTER_NAME if serves_adapter(inference_backend, weight_bridge_mode) else base_name


def max_lora_rank(lora_r: int) -> int:
    """The least ``--max-lora-rank`` vLLM accepts that holds an adapter of rank ``lora_r``."""
    for rank in VLLM_LORA_RANKS:
        if rank >= lora_r:
            return rank
    raise ValueError(
        f"lora_r {lora_r} is above the largest LoRA rank vLLM serves ({VLLM_LORA_RANKS[-1]})"
    )


def lora_server_args(lora_r: int | None, inference_args: Sequence[str] = ()) -> list[str]:
    """vLLM flags that let it serve the trainer's adapter (none when ``inference_args``
    already enable LoRA: the run's own flags win)."""
    if "--enable-lora" in inference_args:
        return []
    return ["--enable-lora", "--max-lora-rank", str(max_lora_rank(lora_r or DEFAULT_LORA_R))]


def served_models(url: str, timeout: float = 5.0) -> list[str]:
    """The model ids ``GET {url}/v1/models`` lists (base model and loaded adapters)."""
    resp = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=timeout)
    resp.raise_for_status()
    return [str(m.get("id")) for m in resp.json().get("data", [])]


def wait_for_adapter(
    url: str,
    timeout: float,
    trainer_failure: Callable[[], str | None] = lambda: None,
    name: str = VLLM_ADAPTER_NAME,
    interval: float = 0.2,
) -> float:
    """Wait until vLLM at ``url`` lists the adapter ``name``; returns the seconds waited.

    ``trainer_failure()`` returns why the trainer is gone (it loads the adapter), or None
    while it runs: a dead trainer ends the wait at once with that reason.
    """
    t0 = time.monotonic()
    deadline = t0 + timeout
    last = "no answer yet"
    while True:
        try:
            models = served_models(url)
            if name in models:
                return time.monotonic() - t0
            last = f"it serves {models}"
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            last = f"{url}/v1/models: {exc}"
        why = trainer_failure()
        if why is not None:
            raise AdapterWaitError(
                f"the trainer exited before it loaded the LoRA adapter {name!r} into vLLM: {why}"
            )
        if time.monotonic() >= deadline:
            raise AdapterWaitError(
                f"vLLM at {url} did not serve the LoRA adapter {name!r} within {timeout:.0f}s "
                f"({last})"
            )
        time.sleep(interval)
