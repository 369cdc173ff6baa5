"""The error the vLLM-only modules raise when vLLM is not installed."""

from __future__ import annotations

import importlib.util

VLLM_EXTRA = "atroposlib[openai_endpoint]"


def require_vllm(module: str) -> None:
    """ImportError naming vLLM and the extra that installs it, unless vLLM is importable;
    with vLLM installed, ImportError saying what to use instead (this package does not ship
    the original's vLLM bridge)."""
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(
            f"{module} needs vLLM, which is not installed: pip install '{VLLM_EXTRA}' "
            "(or pip install vllm)"
        )
    raise ImportError(
        f"{module} (the original's patched vLLM server with CUDA-IPC weight sharing) is not "
        "provided by this package; serve with vLLM's own OpenAI server "
        "(python -m vllm.entrypoints.openai.api_server) or atropos-serve-model, and use "
        "weight_bridge_mode none, lora_only, lora_restart or http_reload"
    )
