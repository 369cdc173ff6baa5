"""Load a causal LM and its tokenizer, and check that a new checkpoint fits the old one."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch

from atroposlib.http.openai_protocol import Forbidden, InvalidRequest
from atroposlib.serving.config import ServeModelConfig

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """Map ``auto|cpu|cuda`` to a torch device (auto → cuda when available)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but CUDA is not available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """Map a dtype name to torch; auto is float32 on CPU, bfloat16 (or fp16) on CUDA."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def load_model(path: str, device: torch.device, dtype: torch.dtype) -> Any:
    """Load ``AutoModelForCausalLM`` from ``path`` onto ``device`` in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


def load_tokenizer(path: str) -> Any:
    """Load the tokenizer of ``path`` (a pad token is set to eos when missing)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    return tok


def load_compatible(path: str, current: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """Load a checkpoint for a weight update; it must match ``current`` tensor for tensor.

    Raises :class:`InvalidRequest` (param ``path``) when the directory is missing or
    unreadable, is another model type, or holds a tensor set other than the served
    model's: a missing tensor (which loading would silently initialise afresh), an
    unexpected one (which loading would silently drop) or one of another shape. The
    message names the first such tensor. Nothing reaches the device before the check.
    """
    from transformers import AutoModelForCausalLM

    if not os.path.isdir(path):
        raise InvalidRequest(f"checkpoint directory {path!r} does not exist", param="path")
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, output_loading_info=True, ignore_mismatched_sizes=True
        )
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise InvalidRequest(f"cannot load checkpoint {path!r}: {exc}", param="path") from exc
    if model.config.model_type != current.config.model_type:
        raise InvalidRequest(
            f"checkpoint {path!r} is a {model.config.model_type} model; the "
            f"server runs {current.config.model_type}",
            param="path",
        )
    served = {k: tuple(v.shape) for k, v in current.state_dict().items()}
    problems = [f"{n} is not in the served model" for n in sorted(info.get("unexpected_keys", ()))]
    problems += [
        f"{n} has shape {list(found)}, the served model {list(served.get(n, expected))}"
        for n, found, expected in sorted(info.get("mismatched_keys", ()), key=lambda m: m[0])
    ]
    problems += [f"{n} is missing" for n in sorted(info.get("missing_keys", ()))]
    # The checkpoint's own config may describe another architecture: compare with the server's.
    new = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    problems += [f"{n} is not in the served model" for n in sorted(new.keys() - served.keys())]
    problems += [f"{n} is missing" for n in sorted(served.keys() - new.keys())]
    problems += [
        f"{n} has shape {list(new[n])}, the served model {list(served[n])}"
        for n in sorted(new.keys() & served.keys())
        if new[n] != served[n]
    ]
    if problems:
        raise checkpoint_misfit(path, list(dict.fromkeys(problems)))
    return model.to(device).eval()


def checkpoint_misfit(path: str, problems: list[str]) -> InvalidRequest:
    """The 400 for a checkpoint whose tensors differ from the served model's (first named)."""
    return InvalidRequest(
        f"checkpoint {path!r} does not fit the served model ({len(problems)} "
        f"difference{'s' if len(problems) != 1 else ''}, first: {'; '.join(problems[:3])})",
        param="path",
    )


def weight_roots(config: ServeModelConfig) -> list[str]:
    """Directories ``/update_weights`` may load from: ``--weights-root`` values and the served
    model's parent directory (where a trainer saving next to its base model writes), resolved."""
    roots = [os.path.realpath(r) for r in config.weights_root or []]
    if os.path.isdir(config.model):
        roots.append(os.path.dirname(os.path.realpath(config.model)))
    return list(dict.fromkeys(roots))


def confine_weights_path(path: str, roots: list[str]) -> str:
    """Resolve ``path`` (symlinks, ``..``, relative to the server's directory) and return it if it
    lies inside one of ``roots``; otherwise raise 403.

    The check runs before anything looks at the path, and the answer is the same whether the
    path exists or not, so the endpoint cannot be used to probe the file system.
    """
    if "\x00" in path:
        raise InvalidRequest("'path' must not contain a NUL character", param="path")
    resolved = os.path.realpath(path)
    if not _inside(resolved, roots):
        raise Forbidden(
            "'path' is outside the directories this server loads weights from; start it with "
            "--weights-root DIR to allow another directory",
            param="path",
        )
    _confine_files(resolved, roots)
    return resolved


def _inside(resolved: str, roots: list[str]) -> bool:
    return any(resolved == r or resolved.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def _confine_files(directory: str, roots: list[str]) -> None:
    """Refuse (403) a checkpoint directory holding a file that resolves outside ``roots``.

    Resolving the directory alone lets a ``model.safetensors`` inside it be a symlink to any
    file of the machine; every entry the loaders may open (and every shard an index names)
    is resolved too. Only directories already inside a root get here, so the answer reveals
    nothing about the rest of the file system.
    """
    try:
        names = os.listdir(directory)
    except OSError:
        return  # missing or unreadable: loading reports it (400)
    index = os.path.join(directory, "model.safetensors.index.json")
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        if isinstance(weight_map, dict):
            names.extend(str(v) for v in weight_map.values())
    except (OSError, ValueError, AttributeError, RecursionError):
        pass  # no index, or one the loader will refuse itself
    for name in dict.fromkeys(names):
        if not _inside(os.path.realpath(os.path.join(directory, name)), roots):
            raise Forbidden(
                f"'path' holds {name!r}, which resolves outside the directories this server "
                "loads weights from; copy the file in, or start the server with --weights-root "
                "DIR to allow its directory",
                param="path",
            )


def prompt_char_limit(tokenizer: Any, max_model_len: int) -> int | None:
    """Characters beyond which a text cannot fit ``max_model_len`` tokens, or ``None``.

    No token stands for more characters than its vocabulary entry has (byte-level entries are
    one character per byte, and ``<0x0A>``-style entries are longer than what they encode), so
    ``max_model_len`` times the longest entry bounds what fits. Doubled, for normalisers that
    drop characters.
    """
    try:
        longest = max((len(t) for t in tokenizer.get_vocab()), default=0)
    except (AttributeError, NotImplementedError, TypeError):
        return None
    return 2 * max_model_len * max(longest, 1) if longest else None
