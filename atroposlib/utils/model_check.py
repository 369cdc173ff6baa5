"""Whether a model name can be loaded, answered in one line before anything loads it.

``atropos-grpo --model-name`` and ``atropos-serve-model MODEL`` ask here first: a mistyped
path, an unset shell variable (``"$MODEL"`` expands to nothing) or a hub name that cannot be
reached would otherwise end, after the imports and a wait, in pages of traceback.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["model_problem"]

_PATH_PREFIXES = ("/", "./", "../", "~")


def model_problem(name: str, what: str = "--model-name") -> str | None:
    """Why ``name`` cannot be loaded, in one line that starts with ``what`` (the flag or
    argument that gave it), or None when it can.

    A local directory is fine. A name written as a path (``/``, ``./``, ``../``, ``~``) must
    exist. A hub name must be in the local cache or reachable.
    """
    if not name.strip():
        return (
            f"{what} is empty: give a local model directory or a Hugging Face hub name "
            '(an unset shell variable, such as "$MODEL" in a new terminal, expands to nothing; '
            "the offline tiny model's directory is printed by atropos-tiny-model)"
        )
    path = Path(os.path.expanduser(name))
    if path.exists():
        return None
    if name.startswith(_PATH_PREFIXES):
        return f"{what} {name}: no such directory"
    import huggingface_hub
    from huggingface_hub.errors import HFValidationError
    from transformers import AutoConfig

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    huggingface_hub.logging.set_verbosity_error()
    try:
        AutoConfig.from_pretrained(name)
    except (OSError, ValueError, HFValidationError):
        if offline:
            return (
                f"{what} {name}: not a local directory and not in the Hugging Face cache "
                "(HF_HUB_OFFLINE=1 is set, so the hub was not asked)"
            )
        return (
            f"{what} {name}: not a local directory, and the Hugging Face hub could not resolve "
            "it (no network? download it once, or use a local directory; HF_HUB_OFFLINE=1 "
            "skips the hub)"
        )
    return None
