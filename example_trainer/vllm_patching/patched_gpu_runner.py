"""The original's patched vLLM GPU model runner; needs vLLM (see the package doc)."""

from example_trainer._needs_vllm import require_vllm

require_vllm(__name__)
