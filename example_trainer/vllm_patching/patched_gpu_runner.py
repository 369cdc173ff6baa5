"""The original's patched vLLM GPU model runner, kept so its names import; it patches nothing.

The original replaced vLLM's ``GPUModelRunner`` to export CUDA IPC handles of the weights.
vLLM ships that as its IPC weight-transfer engine, which
:mod:`example_trainer.vllm_api_server` turns on in single-copy mode, so :func:`apply_patches`
patches nothing and says so.
"""

from __future__ import annotations

import logging

from example_trainer._needs_vllm import require_vllm

require_vllm(__name__)

logger = logging.getLogger(__name__)

_PATCHES_APPLIED = False
_PATCHED_RUNNER_CLASS = None


class PatchedGPUModelRunner:
    """Never instantiated: single-copy mode uses vLLM's own model runner and IPC engine."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(
            "PatchedGPUModelRunner is not used: start example_trainer.vllm_api_server with "
            "VLLM_ENABLE_SHARED_WEIGHTS=1, which turns on vLLM's IPC weight transfer"
        )


def apply_patches() -> bool:
    """False: nothing is patched (vLLM's IPC weight-transfer engine does the sharing)."""
    logger.info("no vLLM patches needed: single-copy mode uses vLLM's IPC weight transfer")
    return False


def get_patched_runner() -> type | None:
    """None: no runner is patched."""
    return _PATCHED_RUNNER_CLASS


def is_patched() -> bool:
    """False: no runner is patched."""
    return _PATCHES_APPLIED
