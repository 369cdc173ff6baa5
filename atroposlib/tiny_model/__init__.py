"""Offline tiny model kit: a shipped BPE tokenizer and a tiny random-init causal LM.

Tests, demos and benchmarks use it so that nothing is downloaded::

    from atroposlib.tiny_model import ensure_tiny_model
    model_dir = ensure_tiny_model()      # cached under <repo>/.cache/tiny-model-0-tf<major>
"""

from atroposlib.tiny_model.build import DEFAULT_SIZE, build_tiny_model, ensure_tiny_model
from atroposlib.tiny_model.tokenizer import chat_template, load_tiny_tokenizer

__all__ = [
    "DEFAULT_SIZE",
    "build_tiny_model",
    "chat_template",
    "ensure_tiny_model",
    "load_tiny_tokenizer",
]
