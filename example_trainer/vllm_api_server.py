"""The original's vLLM server with the trainer bridge (``/bridge/*``, ``/lora/*``).

It needs vLLM: importing this module without it raises ImportError naming vLLM and the
extra that installs it (``atroposlib[openai_endpoint]``). This package does not ship the
bridge itself; see :func:`example_trainer._needs_vllm.require_vllm`.
"""

from example_trainer._needs_vllm import require_vllm

require_vllm(__name__)
