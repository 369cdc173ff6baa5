"""Build a tiny random-init causal LM (Qwen2 or Llama) with the shipped tokenizer.

Nothing is downloaded: the config is written here, the weights are drawn from a
seeded generator and the tokenizer is package data. The same seed and sizes give
byte-identical weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal

from atroposlib.tiny_model.tokenizer import TOKENIZER_JSON, load_tiny_tokenizer

logger = logging.getLogger(__name__)

KIT_VERSION = 1
META_FILE = "tiny_model_meta.json"

DEFAULT_SIZE: dict[str, int] = {
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
}


def _config(arch: str, vocab_size: int, eos_id: int, pad_id: int, size: dict[str, int]) -> Any:
    common = dict(
        vocab_size=vocab_size,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        **size,
    )
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(use_sliding_window=False, **common)
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common)
    raise ValueError(f"arch must be 'qwen2' or 'llama', got {arch!r}")


def build_tiny_model(
    out_dir: str | os.PathLike[str],
    seed: int = 0,
    arch: Literal["qwen2", "llama"] = "qwen2",
    **size: int,
) -> str:
    """Write a tiny random-init causal LM plus tokenizer into ``out_dir``; return its path.

    ``size`` overrides entries of :data:`DEFAULT_SIZE` (``hidden_size``,
    ``num_hidden_layers``, ...). The result loads with ``AutoTokenizer`` /
    ``AutoModelForCausalLM.from_pretrained(out_dir)``.

    Example::

        path = build_tiny_model("/tmp/tiny", seed=1, arch="llama", num_hidden_layers=3)
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    unknown = set(size) - set(DEFAULT_SIZE)
    if unknown:
        raise ValueError(f"unknown size fields {sorted(unknown)}; allowed: {sorted(DEFAULT_SIZE)}")
    dims = {**DEFAULT_SIZE, **size}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = load_tiny_tokenizer()
    config = _config(arch, len(tok), tok.eos_token_id, tok.pad_token_id, dims)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    model.generation_config = GenerationConfig(
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, do_sample=True
    )
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    _portable_tokenizer_class(out)
    meta = {
        "kit_version": KIT_VERSION,
        "transformers_major": _transformers_major(),
        "seed": seed,
        "arch": arch,
        "size": dims,
        "tokenizer_sha256": _tokenizer_digest(),
    }
    (out / META_FILE).write_text(json.dumps(meta, indent=2), encoding="utf-8")
    return str(out)


def _transformers_major() -> int:
    # From the metadata: finding a cached model must not import torch.
    from atroposlib.utils.dependencies import installed_major

    return installed_major("transformers")


def _portable_tokenizer_class(out: Path) -> None:
    """Name the tokenizer class both 4.x and 5.x load.

    5.x writes ``TokenizersBackend``, a class 4.x does not have; ``PreTrainedTokenizerFast``
    is what 4.x writes for this tokenizer and what 5.x maps to its own backend. (The model's
    ``config.json`` is not portable the same way: rope fields moved in 5.x, which is why
    the cache is keyed by major version.)
    """
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")


def _tokenizer_digest() -> str:
    return hashlib.sha256(TOKENIZER_JSON.read_bytes()).hexdigest()[:16]


def default_cache_dir() -> Path:
    """Where cached tiny models live: ``<repo>/.cache`` in a checkout, else the user cache.

    ``ATROPOS_TINY_MODEL_CACHE`` overrides both.
    """
    env = os.environ.get("ATROPOS_TINY_MODEL_CACHE")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[2]
    if (repo / "pyproject.toml").exists() and os.access(repo, os.W_OK):
        return repo / ".cache"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "atroposlib"


def default_model_name(seed: int = 0) -> str:
    """Directory name of the cached default tiny model: keyed by seed and by the major
    version of the transformers that writes it (a 5.x directory does not load under 4.x)."""
    return f"tiny-model-{seed}-tf{_transformers_major()}"


def _is_current(path: Path, seed: int) -> bool:
    try:
        meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        meta.get("kit_version") == KIT_VERSION
        and meta.get("transformers_major") == _transformers_major()
        and meta.get("seed") == seed
        and meta.get("tokenizer_sha256") == _tokenizer_digest()
        and meta.get("arch") == "qwen2"
        and meta.get("size") == DEFAULT_SIZE
        and (path / "model.safetensors").exists()
    )


def ensure_tiny_model(path: str | os.PathLike[str] | None = None, seed: int = 0) -> str:
    """Return the directory of the default tiny model for ``seed``, building it once.

    The build happens in a temporary sibling directory that is renamed into place,
    so concurrent callers (several test processes) never see a half-written model:
    whoever renames first wins and the others discard their copy.
    """
    target = Path(path) if path is not None else default_cache_dir() / default_model_name(seed)
    if _is_current(target, seed):
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build_tiny_model(tmp, seed=seed)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared
        if target.exists() and not _is_current(target, seed):
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}-stale-", dir=target.parent))
            with contextlib.suppress(OSError):
                os.rename(target, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_current(target, seed):
                raise
            logger.debug("another process built %s first", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
