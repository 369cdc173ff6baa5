"""The original's patches to vLLM's GPU model runner (shared weights with the trainer).

It needs vLLM: importing this package without it raises ImportError naming vLLM and the
extra that installs it (``atroposlib[openai_endpoint]``).
"""

from example_trainer._needs_vllm import require_vllm

require_vllm(__name__)
