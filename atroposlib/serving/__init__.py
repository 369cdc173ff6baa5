"""Embedded inference server (``atropos-serve-model``): OpenAI-compatible, vLLM-style
``/generate``, continuous batching and hot weight updates, on CPU or one GPU.

The engine's names are imported on first use, so the command line (``serving.config``) loads
without torch and answers a mistake (an empty model, a busy port) in a second.
"""

from __future__ import annotations

import importlib
from typing import Any

from atroposlib.serving.config import ServeModelConfig

__all__ = ["Engine", "GenerationResult", "SamplingParams", "SequenceOutput", "ServeModelConfig"]

_LAZY = {
    "Engine": "atroposlib.serving.engine",
    "GenerationResult": "atroposlib.serving.engine",
    "SequenceOutput": "atroposlib.serving.engine",
    "SamplingParams": "atroposlib.serving.sampling",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
