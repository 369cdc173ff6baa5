"""Getting new weights from the trainer to the inference server.

One class per ``weight_bridge_mode``; all share :class:`WeightSync`'s interface
(``start`` once, ``sync(step)`` after optimizer steps, ``close`` at the end).
In a multi-process run only rank 0 syncs; it gets the full weights gathered from
the shards as ``sync(step, state_dict=...)``.
Every network call and process wait is bounded by ``config.sync_timeout``; a
failure raises :class:`WeightSyncError` with the reason, it never hangs.

- ``none``: save a checkpoint and restart the inference server on it (vLLM or
  ``atropos-serve-model``).
- ``http_reload``: save the weights and ``POST /update_weights {"path": DIR, "version":
  STEP}`` to ``atropos-serve-model`` (no restart); checks the returned ``version``. With
  ``sync_mode="pause"`` the server is paused first (``POST /pause``: in-flight requests
  finish, new ones wait) and resumed after the update, even when it fails.
  Against vLLM's own server (found at ``start``: it answers ``GET /weight_info``), always
  paused: the weights are reloaded in place through its RL routes and named by the step
  (:mod:`.vllm_weights`); a failed load puts the previous weights back before resuming.
- ``lora_only``: save the adapter and ``POST /lora/load`` (vLLM's custom server);
  a server without that endpoint (404) gets the merged weights via
  ``/update_weights`` instead. Against vLLM's own server the adapter is loaded under
  :data:`VLLM_ADAPTER_NAME` through ``/v1/load_lora_adapter`` at start (untrained) and
  replaced in place at each sync (environments request that name as their model).
- ``lora_restart``: merge the adapter and restart the server on the merged model.
"""

from __future__ import annotations

import copy
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import httpx

from atroposlib.serving.weights_version import write_weights_version

from .checkpointing import save_model_dir
from .config import TrainingConfig
from .vllm_manager import InferenceProcess, InferenceServerError
from .vllm_weights import (
    VLLMWeightClient,
    VLLMWeightError,
    is_vllm_server,
    write_tied_lm_head,
)

logger = logging.getLogger(__name__)


VLLM_ADAPTER_NAME = "policy-lora"
"""The name ``lora_only`` loads the trained adapter under in vLLM's own server."""


class WeightSyncError(RuntimeError):
    """A weight sync failed or timed out."""


def merged_copy(model: Any) -> Any:
    """A plain model with LoRA adapters merged in (the trained model is untouched)."""
    if hasattr(model, "merge_and_unload"):
        return copy.deepcopy(model).merge_and_unload()
    return model


class WeightSync:
    """Base class: no-op sync (used when nothing has to be pushed)."""

    def __init__(self, config: TrainingConfig, model: Any, tokenizer: Any) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.url = config.resolved_inference_url
        self.root = Path(config.save_path)
        self.syncs = 0

    def start(self) -> None:
        """Called once before training."""

    def sync(self, step: int, state_dict: dict | None = None) -> float:
        """Push the current weights (``state_dict``: gathered full weights); returns seconds taken."""
        return 0.0

    def close(self) -> None:
        """Release resources (stop processes the sync owns)."""

    def should_sync(self, step: int) -> bool:
        """Whether to sync after optimizer step ``step`` (1-based)."""
        return step % self.config.vllm_restart_interval == 0 or step >= self.config.training_steps


class HttpReloadSync(WeightSync):
    """``POST /update_weights`` to ``atropos-serve-model`` with a freshly saved weights dir."""

    def __init__(self, config: TrainingConfig, model: Any, tokenizer: Any) -> None:
        super().__init__(config, model, tokenizer)
        self.live_root = self.root / "live_weights"
        self._previous: Path | None = None
        self.last_version: int | None = None
        self.vllm: VLLMWeightClient | None = None
        """Set at ``start`` when the server is vLLM's own (its RL routes instead of ours)."""

    def start(self) -> None:
        timeout = min(10.0, self.config.sync_timeout)
        try:
            resp = httpx.get(f"{self.url}/health", timeout=timeout)
        except httpx.HTTPError as exc:
            raise WeightSyncError(
                f"http_reload: inference server {self.url} not reachable: {exc}"
            ) from exc
        if resp.status_code != 200:
            raise WeightSyncError(f"http_reload: {self.url}/health answered {resp.status_code}")
        try:
            health = resp.json()
        except ValueError:
            health = None
        # atropos-serve-model's /health is a JSON object; vLLM's is an empty 200, and its dev
        # routes answer GET /weight_info.
        if not isinstance(health, dict) and is_vllm_server(self.url, timeout=timeout):
            base = Path(self.config.model_name)
            self.vllm = VLLMWeightClient(
                self.url, self.config.sync_timeout, base if base.is_dir() else None
            )
            logger.info(
                "%s: vLLM's own server; weights reload in place via /collective_rpc",
                self.config.weight_bridge_mode,
            )
            return
        served = health.get("version") if isinstance(health, dict) else None
        self.last_version = served if isinstance(served, int) else self.last_version

    def _post(self, path: Path, step: int | None = None) -> dict:
        body: dict = {"path": str(path.resolve())}
        if step is not None and (self.last_version is None or step > self.last_version):
            # Name the weights by the trainer step, so rollouts' policy versions and the
            # rollout API's step count the same thing.
            body["version"] = step
        try:
            resp = httpx.post(
                f"{self.url}/update_weights",
                json=body,
                timeout=self.config.sync_timeout,
            )
        except httpx.TimeoutException as exc:
            raise WeightSyncError(
                f"http_reload: /update_weights timed out after {self.config.sync_timeout:.0f}s"
            ) from exc
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"http_reload: /update_weights failed: {exc}") from exc
        if resp.status_code == 404:
            raise WeightSyncError(
                f"http_reload: {self.url} has no /update_weights (is it atropos-serve-model?)"
            )
        if resp.status_code >= 400:
            raise WeightSyncError(
                f"http_reload: /update_weights answered {resp.status_code}: {resp.text[:300]}"
            )
        try:
            return resp.json()
        except ValueError:
            return {}

    def _control(self, route: str, body: dict) -> dict:
        """``POST /pause`` or ``/resume`` (``--sync-mode pause``); errors are WeightSyncError."""
        try:
            resp = httpx.post(f"{self.url}{route}", json=body, timeout=self.config.sync_timeout)
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"http_reload: {route} failed: {exc}") from exc
        if resp.status_code >= 400:
            raise WeightSyncError(
                f"http_reload: {route} answered {resp.status_code}: {resp.text[:300]} "
                "(does the server support --sync-mode pause?)"
            )
        return resp.json()

    def sync(self, step: int, state_dict: dict | None = None) -> float:
        if self.vllm is not None:
            return self._sync_vllm(self.vllm, step, state_dict)
        if self.config.sync_mode != "pause":
            return self._sync(step, state_dict)
        t0 = time.perf_counter()
        paused = self._control(
            "/pause",
            {"mode": "finish", "timeout": self.config.sync_timeout},
        )
        if not paused.get("drained", True):
            logger.warning("http_reload: %s request(s) still in flight", paused.get("in_flight"))
        try:
            self._sync(step, state_dict)
        finally:
            self._control("/resume", {})
        return time.perf_counter() - t0

    def _sync_vllm(self, vllm: VLLMWeightClient, step: int, state_dict: dict | None) -> float:
        """Save, then pause → reload in place → version ``step`` → resume (vLLM's own server)."""
        t0 = time.perf_counter()
        target = self.live_root / f"step_{step}"
        save_model_dir(merged_copy(self.model), self.tokenizer, target, state_dict)
        write_tied_lm_head(target)  # vLLM's in-place reload leaves a tied head stale otherwise
        try:
            vllm.reload(target, step)
        except VLLMWeightError as exc:
            raise WeightSyncError(
                f"http_reload: vLLM did not take the weights of step {step} "
                f"(it still serves the previous ones): {exc}"
            ) from exc
        self.last_version = step
        if self._previous is not None and self._previous != target:
            shutil.rmtree(self._previous, ignore_errors=True)
        self._previous = target
        self.syncs += 1
        return time.perf_counter() - t0

    def _sync(self, step: int, state_dict: dict | None = None) -> float:
        t0 = time.perf_counter()
        target = self.live_root / f"step_{step}"
        save_model_dir(merged_copy(self.model), self.tokenizer, target, state_dict)
        write_weights_version(target, step)
        data = self._post(target, step)
        version = data.get("version")
        if (
            isinstance(version, int)
            and self.last_version is not None
            and version <= self.last_version
        ):
            raise WeightSyncError(
                f"http_reload: server version did not advance ({self.last_version} → {version})"
            )
        self.last_version = version if isinstance(version, int) else self.last_version
        if self._previous is not None and self._previous != target:
            shutil.rmtree(self._previous, ignore_errors=True)
        self._previous = target
        self.syncs += 1
        return time.perf_counter() - t0


class RestartSync(WeightSync):
    """Mode ``none`` (and ``lora_restart``): checkpoint, then restart the inference server on it."""

    def __init__(self, config: TrainingConfig, model: Any, tokenizer: Any) -> None:
        super().__init__(config, model, tokenizer)
        log = Path(config.metrics_dir) / "inference_server.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        self.server = InferenceProcess(
            backend=config.inference_backend,
            port=config.vllm_port,
            served_model_name=config.model_name,
            log_path=log,
            timeout=config.sync_timeout,
            gpu_memory_utilization=config.vllm_gpu_memory_utilization,
            max_model_len=config.max_model_len,
            gpu=config.vllm_gpu,
        )
        self._previous: Path | None = None

    def start(self) -> None:
        if self.config.launch_inference:
            try:
                self.server.start(self.config.model_name)
            except InferenceServerError as exc:
                raise WeightSyncError(f"could not start the inference server: {exc}") from exc

    def sync(self, step: int, state_dict: dict | None = None) -> float:
        t0 = time.perf_counter()
        target = self.root / "served_weights" / f"step_{step}"
        save_model_dir(merged_copy(self.model), self.tokenizer, target, state_dict)
        write_weights_version(target, step)  # the restarted server reports this version
        try:
            self.server.restart(str(target))
        except InferenceServerError as exc:
            raise WeightSyncError(f"restart on {target} failed: {exc}") from exc
        if self._previous is not None and self._previous != target:
            shutil.rmtree(self._previous, ignore_errors=True)
        self._previous = target
        self.syncs += 1
        return time.perf_counter() - t0

    def close(self) -> None:
        self.server.stop()


class LoraOnlySync(HttpReloadSync):
    """Hot-swap the adapter through ``POST /lora/load``; merged ``/update_weights`` fallback.
    Against vLLM's own server: its ``/v1/load_lora_adapter``, in place under one name."""

    def start(self) -> None:
        super().start()
        if self.vllm is not None:
            # The untrained adapter (LoRA's B starts at zero: the base model's outputs), so the
            # name the environments request exists before the first sync.
            self._load_vllm_adapter(self.vllm, 0, replace=False)

    def _load_vllm_adapter(self, vllm: VLLMWeightClient, step: int, replace: bool) -> None:
        adapter = self.root / f"adapter_step_{step}"
        save_model_dir(self.model, None, adapter)
        try:
            vllm.pause()
            try:
                vllm.load_lora(VLLM_ADAPTER_NAME, adapter, replace=replace)
                vllm.set_version(step)
            finally:
                vllm.resume()
        except VLLMWeightError as exc:
            raise WeightSyncError(
                f"lora_only: vLLM did not take the adapter of step {step}: {exc}"
            ) from exc
        if self._previous is not None and self._previous != adapter:
            shutil.rmtree(self._previous, ignore_errors=True)
        self._previous = adapter

    def sync(self, step: int, state_dict: dict | None = None) -> float:
        t0 = time.perf_counter()
        if self.vllm is not None:
            self._load_vllm_adapter(self.vllm, step, replace=True)
            self.last_version = step
            self.syncs += 1
            return time.perf_counter() - t0
        adapter = self.root / f"adapter_step_{step}"
        save_model_dir(self.model, None, adapter)
        try:
            resp = httpx.post(
                f"{self.url}/lora/load",
                json={"adapter_path": str(adapter.resolve()), "adapter_name": f"step_{step}"},
                timeout=self.config.sync_timeout,
            )
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"lora_only: /lora/load failed: {exc}") from exc
        if resp.status_code == 404:
            return super().sync(step) + (time.perf_counter() - t0)
        if resp.status_code >= 400:
            raise WeightSyncError(
                f"lora_only: /lora/load answered {resp.status_code}: {resp.text[:300]}"
            )
        self.syncs += 1
        return time.perf_counter() - t0


def make_weight_sync(config: TrainingConfig, model: Any, tokenizer: Any) -> WeightSync:
    """The :class:`WeightSync` for ``config.weight_bridge_mode``."""
    mode = config.weight_bridge_mode
    if mode == "http_reload":
        return HttpReloadSync(config, model, tokenizer)
    if mode in ("none", "lora_restart"):
        return RestartSync(config, model, tokenizer)
    if mode == "lora_only":
        return LoraOnlySync(config, model, tokenizer)
    raise WeightSyncError(f"weight_bridge_mode {mode!r} is not supported by this trainer")
