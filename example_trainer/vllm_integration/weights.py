"""New weights into vLLM's own OpenAI server, through the routes it serves today.

vLLM started with ``VLLM_SERVER_DEV_MODE=1`` serves ``POST /pause`` / ``POST /resume``,
``POST /collective_rpc`` (its workers' ``reload_weights(weights_path=DIR)``: the weights of a
model directory loaded in place), ``POST /update_weight_version`` and ``GET /weight_info``;
with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` also
``POST /v1/load_lora_adapter``. :class:`VLLMWeightClient` drives them for the trainer's
``http_reload`` and ``lora_only`` modes:

- :meth:`~VLLMWeightClient.reload`: check the new directory (every safetensors file opens and
  holds the same tensor names, shapes and dtypes as the last good weights), pause (in-flight
  requests finish, new ones wait), reload in place, name the version, resume. No request runs
  while the weights are being replaced. A directory that fails the check is refused before
  the server is touched: it keeps serving the old weights under the old version, and
  :class:`VLLMWeightError` says why. The check matters because vLLM 0.32 cannot undo a load
  that fails half-way (its in-place reload leaves the model unusable, and loading the old
  directory again fails too); should that still happen, the last good weights are tried
  once, the server resumes and the error says the server needs a restart.
- :meth:`~VLLMWeightClient.load_lora`: load (or replace in place) a LoRA adapter by name.

:func:`write_tied_lm_head` works around a vLLM 0.32 bug: its in-place reload of a model with
tied input/output embeddings (``tie_word_embeddings``) updates the embedding but leaves the
output projection with the old weights (the served logprobs then come from a mix of old and
new weights). A checkpoint that holds ``lm_head.weight`` explicitly is loaded correctly, so the
trainer writes one into each directory it reloads.

:func:`is_vllm_server` tells vLLM (``GET /weight_info`` answers) from ``atropos-serve-model``
(whose ``/health`` names its version), which keeps its own ``/update_weights`` route.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import httpx

logger = logging.getLogger(__name__)


class VLLMWeightError(RuntimeError):
    """A weight or adapter update of vLLM failed (the old weights still serve)."""


def is_vllm_server(url: str, timeout: float = 10.0) -> bool:
    """Whether ``url`` is vLLM's own server with its RL routes (``GET /weight_info`` → 200)."""
    try:
        resp = httpx.get(f"{url}/weight_info", timeout=timeout)
    except httpx.HTTPError:
        return False
    if resp.status_code != 200:
        return False
    try:
        return "weight_version" in resp.json()
    except ValueError:
        return False


Signature = dict[str, tuple[tuple[int, ...], str]]


def weights_signature(model_dir: str | Path) -> Signature:
    """Tensor name → (shape, dtype) over the ``*.safetensors`` files of ``model_dir``.

    Raises :class:`VLLMWeightError` when there are none or one does not open (a truncated
    or half-written file).
    """
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise VLLMWeightError(f"{model_dir} holds no *.safetensors weights")
    shapes: Signature = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    part = st.get_slice(name)
                    shapes[name] = (tuple(part.get_shape()), str(part.get_dtype()))
        except Exception as exc:  # safetensors raises its own error types
            raise VLLMWeightError(f"{f} is not a readable safetensors file: {exc}") from exc
    return shapes


TIED_HEAD = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"


def write_tied_lm_head(model_dir: str | Path) -> bool:
    """Add ``lm_head.weight`` (a copy of the input embedding) to the safetensors file holding
    the embedding when ``config.json`` says the two are tied and the file has no head; whether
    it wrote one. See the module docstring for why vLLM's reload needs it."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    model_dir = Path(model_dir)
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    tied = config.get("tie_word_embeddings")
    if tied is None:
        tied = (config.get("text_config") or {}).get("tie_word_embeddings", False)
    if not tied:
        return False
    for f in sorted(model_dir.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as st:
                names = set(st.keys())
                metadata = st.metadata()
        except Exception:  # an unreadable file: VLLMWeightClient.check names it
            return False
        if TIED_HEAD in names:
            return False
        if EMBEDDING in names:
            tensors = load_file(str(f))
            tensors[TIED_HEAD] = tensors[EMBEDDING].clone()
            tmp = f.with_name(f.name + ".tmp")
            save_file(tensors, str(tmp), metadata=metadata or {"format": "pt"})
            tmp.replace(f)
            _add_to_index(model_dir, f.name)
            return True
    return False


def _add_to_index(model_dir: Path, file_name: str) -> None:
    """Name the added head in a sharded checkpoint's index (loaders that read it see it)."""
    import json

    index = model_dir / "model.safetensors.index.json"
    if not index.exists():
        return
    data = json.loads(index.read_text(encoding="utf-8"))
    data.setdefault("weight_map", {})[TIED_HEAD] = file_name
    index.write_text(json.dumps(data, indent=2), encoding="utf-8")


def signature_mismatch(new: Signature, good: Signature) -> str | None:
    """Why ``new`` cannot replace ``good`` (missing, extra, reshaped or retyped tensors), or None.

    An explicit tied head (:func:`write_tied_lm_head`) on one side only is no difference.
    """
    if (TIED_HEAD in new) != (TIED_HEAD in good):
        new = {k: v for k, v in new.items() if k != TIED_HEAD}
        good = {k: v for k, v in good.items() if k != TIED_HEAD}
    missing = sorted(set(good) - set(new))
    extra = sorted(set(new) - set(good))
    reshaped = sorted(n for n in set(new) & set(good) if new[n] != good[n])
    problems = []
    if missing:
        problems.append(f"missing {missing[:5]}")
    if extra:
        problems.append(f"unexpected {extra[:5]}")
    if reshaped:
        n = reshaped[0]
        problems.append(f"{len(reshaped)} differ (e.g. {n}: {new[n]} vs {good[n]})")
    return "; ".join(problems) or None


class VLLMWeightClient:
    """The weight routes of one vLLM server (see the module docstring)."""

    def __init__(self, url: str, timeout: float, good_dir: str | Path | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.good_dir = Path(good_dir) if good_dir is not None else None
        """The directory of the weights serving now (what a failed load falls back to)."""
        self._good_signature: Signature | None = None
        self.reloads = 0
        self.failures = 0

    # -- routes
    def _post(self, route: str, **kwargs: Any) -> httpx.Response:
        try:
            resp = httpx.post(f"{self.url}{route}", timeout=self.timeout, **kwargs)
        except httpx.TimeoutException as exc:
            raise VLLMWeightError(f"{route} timed out after {self.timeout:.0f}s") from exc
        except httpx.HTTPError as exc:
            raise VLLMWeightError(f"{route} failed: {exc}") from exc
        if resp.status_code >= 400:
            raise VLLMWeightError(f"{route} answered {resp.status_code}: {resp.text[:500]}")
        return resp

    def weight_version(self) -> str | None:
        """``GET /weight_info``'s ``weight_version`` (None when unreadable)."""
        try:
            return (
                httpx.get(f"{self.url}/weight_info", timeout=self.timeout)
                .json()
                .get("weight_version")
            )
        except (httpx.HTTPError, ValueError, AttributeError):
            return None

    def pause(self) -> None:
        """Stop scheduling: running requests finish (``mode=wait``), new ones wait."""
        self._post("/pause", params={"mode": "wait"})

    def resume(self) -> None:
        """Schedule requests again."""
        self._post("/resume")

    def set_version(self, version: int | str) -> None:
        """``POST /update_weight_version`` (what rollouts then record as their policy version)."""
        self._post("/update_weight_version", json={"new_version": str(version)})

    def _reload_rpc(self, model_dir: Path) -> None:
        self._post(
            "/collective_rpc",
            json={
                "method": "reload_weights",
                "kwargs": {"weights_path": str(model_dir.resolve())},
                "timeout": self.timeout,
            },
        )

    # -- updates
    def check(self, model_dir: str | Path) -> None:
        """Raise :class:`VLLMWeightError` unless ``model_dir`` can replace the good weights."""
        new = weights_signature(model_dir)
        if self._good_signature is None and self.good_dir is not None:
            try:
                self._good_signature = weights_signature(self.good_dir)
            except VLLMWeightError:
                self._good_signature = None  # e.g. a hub name: nothing to compare with
        if self._good_signature is not None:
            why = signature_mismatch(new, self._good_signature)
            if why:
                raise VLLMWeightError(f"{model_dir} does not match the served model: {why}")

    def reload(self, model_dir: str | Path, version: int | str, check: bool = True) -> float:
        """Load ``model_dir`` in place as weight version ``version``; seconds taken.

        Nothing is served between the pause and the resume, so no request sees a mix of old
        and new weights. On failure the last good weights are reloaded (when known), the
        server resumes and :class:`VLLMWeightError` is raised.
        """
        t0 = time.perf_counter()
        model_dir = Path(model_dir)
        try:
            if check:
                self.check(model_dir)
        except VLLMWeightError:
            self.failures += 1
            raise
        self.pause()
        try:
            try:
                self._reload_rpc(model_dir)
            except VLLMWeightError as exc:
                self.failures += 1
                self._restore(exc)
                raise
            self.set_version(version)
        finally:
            self.resume()
        self.good_dir = model_dir
        self.reloads += 1
        return time.perf_counter() - t0

    def _restore(self, cause: Exception) -> None:
        """After a failed load: try the last good weights once (still paused)."""
        restart = "the server's weights are in an unknown state: restart it"
        if self.good_dir is None:
            raise VLLMWeightError(f"{cause}; {restart}") from cause
        logger.error("vLLM weight load failed (%s); loading %s back", cause, self.good_dir)
        try:
            self._reload_rpc(self.good_dir)
        except VLLMWeightError as exc:
            raise VLLMWeightError(
                f"{cause}; loading the previous weights {self.good_dir} back failed too "
                f"({exc}); {restart}"
            ) from exc

    def load_lora(self, name: str, adapter_dir: str | Path, replace: bool) -> None:
        """``POST /v1/load_lora_adapter`` (``replace``: swap the weights of the adapter
        already loaded under ``name`` in place)."""
        self._post(
            "/v1/load_lora_adapter",
            json={
                "lora_name": name,
                "lora_path": str(Path(adapter_dir).resolve()),
                "load_inplace": replace,
            },
        )
