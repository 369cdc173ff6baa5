"""The original's patches to vLLM's GPU model runner, kept as names only.

Nothing in vLLM is patched any more: single-copy mode (``VLLM_ENABLE_SHARED_WEIGHTS=1``) goes
through vLLM's own IPC weight-transfer engine (see :mod:`example_trainer.vllm_api_server`).
Importing this package without vLLM raises ImportError naming ``make .venv-vllm`` and the extra.
"""

# Without vLLM this import raises ImportError naming ``make .venv-vllm`` and the extra.
from example_trainer.vllm_patching.patched_gpu_runner import (
    PatchedGPUModelRunner,
    apply_patches,
    get_patched_runner,
    is_patched,
)

__all__ = ["PatchedGPUModelRunner", "apply_patches", "get_patched_runner", "is_patched"]
