"""Embedded inference server (``atropos-serve-model``): OpenAI-compatible, vLLM-style
``/generate``, continuous batching and hot weight updates, on CPU or one GPU."""

from atroposlib.serving.config import ServeModelConfig
from atroposlib.serving.engine import Engine, GenerationResult, SequenceOutput
from atroposlib.serving.sampling import SamplingParams

__all__ = ["Engine", "GenerationResult", "SamplingParams", "SequenceOutput", "ServeModelConfig"]
