"""Getting new weights from the trainer to the inference server.

One class per ``weight_bridge_mode``; all share :class:`WeightSync`'s interface
(``start`` once, ``sync(step)`` after optimizer steps, ``close`` at the end).
In a multi-process run only rank 0 syncs; it gets the full weights gathered from
the shards as ``sync(step, state_dict=...)``. ``http_reload`` pushes to every server of
``config.resolved_inference_urls`` (``--inference-url``, ``--inference-urls``,
``--inference-urls-file``) at once, and fails only when none took the weights.
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
  (:mod:`.vllm_integration.weights`); a failed load puts the previous weights back before resuming.
- ``lora_only``: save the adapter and ``POST /lora/load`` (vLLM's custom server);
  a server without that endpoint (404) gets the merged weights via
  ``/update_weights`` instead. Against vLLM's own server the adapter is loaded under
  :data:`VLLM_ADAPTER_NAME` through ``/v1/load_lora_adapter`` at start (untrained) and
  replaced in place at each sync (environments request that name as their model;
  ``atropos-grpo-run`` points them at it, see :mod:`.vllm_integration.lora`).
- ``lora_restart``: merge the adapter and restart the server on the merged model.
"""

from __future__ import annotations

import copy
import logging
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, List

import httpx

from atroposlib.serving.weights_version import write_weights_version
from atroposlib.utils.io import auth_headers

from .checkpointing import save_model_dir
from .config import TrainingConfig
from .launch.inference_process import InferenceProcess, InferenceServerError
from .vllm_integration.lora import VLLM_ADAPTER_NAME
from .vllm_integration.weights import (
    VLLMWeightClient,
    VLLMWeightError,
    is_vllm_server,
    write_tied_lm_head,
)

logger = logging.getLogger(__name__)


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
    """``POST /update_weights`` to every ``atropos-serve-model`` (or vLLM server) of the run.

    The weights are saved once per sync and each server is told to load them, all at once
    (one thread per server). A sync fails only when no server took the weights; the servers
    that did not are named in the log and kept in :attr:`failed` (a server that is down now
    gets the next sync's weights once it is back). With one server every failure raises,
    as before there were several.
    """

    def __init__(self, config: TrainingConfig, model: Any, tokenizer: Any) -> None:
        super().__init__(config, model, tokenizer)
        self.urls: List[str] = config.resolved_inference_urls
        self.url = self.urls[0]
        self.live_root = self.root / "live_weights"
        self._previous: Path | None = None
        self.last_version: int | None = None
        self.versions: Dict[str, int | None] = {u: None for u in self.urls}
        """The version each server last reported (None: not known yet)."""
        self.vllm_clients: Dict[str, VLLMWeightClient] = {}
        """Set at ``start`` for the servers that are vLLM's own (its RL routes instead of ours)."""
        self.failed: Dict[str, str] = {}
        """The servers the last sync (or ``start``) did not reach, with the reason."""
        self.failures = 0
        """Server updates that failed since the start, over all servers."""

    @property
    def vllm(self) -> VLLMWeightClient | None:
        """The vLLM client of the first server, when it is vLLM's own."""
        return self.vllm_clients.get(self.url)

    def start(self) -> None:
        errors = self._each(self.urls, self._probe)
        self._settle(errors, "start", len(self.urls))

    def _probe(self, url: str) -> None:
        timeout = min(10.0, self.config.sync_timeout)
        try:
            resp = httpx.get(f"{url}/health", headers=auth_headers(), timeout=timeout)
        except httpx.HTTPError as exc:
            raise WeightSyncError(
                f"http_reload: inference server {url} not reachable: {exc}"
            ) from exc
        if resp.status_code != 200:
            raise WeightSyncError(f"http_reload: {url}/health answered {resp.status_code}")
        try:
            health = resp.json()
        except ValueError:
            health = None
        # atropos-serve-model's /health is a JSON object; vLLM's is an empty 200, and its dev
        # routes answer GET /weight_info.
        if not isinstance(health, dict) and is_vllm_server(url, timeout=timeout):
            base = Path(self.config.model_name)
            self.vllm_clients[url] = VLLMWeightClient(
                url, self.config.sync_timeout, base if base.is_dir() else None
            )
            logger.info(
                "%s: %s is vLLM's own server; weights reload in place via /collective_rpc",
                self.config.weight_bridge_mode,
                url,
            )
            return
        served = health.get("version") if isinstance(health, dict) else None
        if isinstance(served, int):
            self.versions[url] = served
            self.last_version = max(served, self.last_version or served)

    # -- one server
    def _post(self, url: str, path: Path, step: int | None = None) -> dict:
        body: dict = {"path": str(path.resolve())}
        known = self.versions.get(url)
        if step is not None and (known is None or step > known):
            # Name the weights by the trainer step, so rollouts' policy versions and the
            # rollout API's step count the same thing.
            body["version"] = step
        try:
            resp = httpx.post(
                f"{url}/update_weights",
                json=body,
                headers=auth_headers(),  # servers started with --api-key take the run's key
                timeout=self.config.sync_timeout,
            )
        except httpx.TimeoutException as exc:
            raise WeightSyncError(
                f"http_reload: {url}/update_weights timed out after {self.config.sync_timeout:.0f}s"
            ) from exc
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"http_reload: {url}/update_weights failed: {exc}") from exc
        if resp.status_code == 404:
            raise WeightSyncError(
                f"http_reload: {url} has no /update_weights (is it atropos-serve-model?)"
            )
        if resp.status_code >= 400:
            raise WeightSyncError(
                f"http_reload: {url}/update_weights answered {resp.status_code}: {resp.text[:300]}"
            )
        try:
            return resp.json()
        except ValueError:
            return {}

    def _control(self, url: str, route: str, body: dict) -> dict:
        """``POST /pause`` or ``/resume`` (``--sync-mode pause``); errors are WeightSyncError."""
        try:
            resp = httpx.post(
                f"{url}{route}", json=body, headers=auth_headers(), timeout=self.config.sync_timeout
            )
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"http_reload: {url}{route} failed: {exc}") from exc
        if resp.status_code >= 400:
            raise WeightSyncError(
                f"http_reload: {url}{route} answered {resp.status_code}: {resp.text[:300]} "
                "(does the server support --sync-mode pause?)"
            )
        return resp.json()

    def _update(self, url: str, target: Path, step: int) -> None:
        """Have one server load ``target`` as version ``step``."""
        vllm = self.vllm_clients.get(url)
        if vllm is not None:
            try:
                vllm.reload(target, step)
            except VLLMWeightError as exc:
                raise WeightSyncError(
                    f"http_reload: vLLM at {url} did not take the weights of step {step} "
                    f"(it still serves the previous ones): {exc}"
                ) from exc
            self.versions[url] = step
            return
        paused = self.config.sync_mode == "pause"
        if paused:
            state = self._control(
                url, "/pause", {"mode": "finish", "timeout": self.config.sync_timeout}
            )
            if not state.get("drained", True):
                logger.warning(
                    "http_reload: %s: %s request(s) still in flight", url, state.get("in_flight")
                )
        try:
            version = self._post(url, target, step).get("version")
        finally:
            if paused:
                self._control(url, "/resume", {})
        known = self.versions.get(url)
        if isinstance(version, int) and known is not None and version <= known:
            raise WeightSyncError(
                f"http_reload: {url}: server version did not advance ({known} → {version})"
            )
        if isinstance(version, int):
            self.versions[url] = version

    # -- the fleet
    def _each(self, urls: List[str], fn: Callable[[str], None]) -> Dict[str, WeightSyncError]:
        """Run ``fn(url)`` for every server at once; the errors by server."""
        errors: Dict[str, WeightSyncError] = {}

        def one(url: str) -> None:
            try:
                fn(url)
            except WeightSyncError as exc:
                errors[url] = exc

        if len(urls) == 1:
            one(urls[0])
            return errors
        with ThreadPoolExecutor(max_workers=min(len(urls), 32)) as pool:
            list(pool.map(one, urls))
        return errors

    def _settle(self, errors: Dict[str, WeightSyncError], what: str, total: int) -> None:
        """Raise when every server failed (one server: its own error); log the others."""
        self.failed = {u: str(e) for u, e in errors.items()}
        self.failures += len(errors)
        if not errors:
            return
        if total == 1:
            raise next(iter(errors.values()))
        if len(errors) == total:
            raise WeightSyncError(
                f"http_reload: {what} failed on all {total} inference servers: "
                + "; ".join(self.failed.values())
            )
        for url, why in self.failed.items():
            logger.warning("http_reload: %s: %s did not take part: %s", what, url, why)
        logger.warning(
            "http_reload: %s reached %d of %d inference servers; failed: %s",
            what,
            total - len(errors),
            total,
            ", ".join(self.failed),
        )

    def sync(self, step: int, state_dict: dict | None = None) -> float:
        t0 = time.perf_counter()
        target = self.live_root / f"step_{step}"
        save_model_dir(merged_copy(self.model), self.tokenizer, target, state_dict)
        write_weights_version(target, step)
        if self.vllm_clients:
            write_tied_lm_head(target)  # vLLM's in-place reload leaves a tied head stale otherwise
        errors = self._each(self.urls, lambda url: self._update(url, target, step))
        self._settle(errors, f"weight sync of step {step}", len(self.urls))
        reported = [v for u, v in self.versions.items() if u not in errors and v is not None]
        self.last_version = max(reported) if reported else self.last_version
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
    Against vLLM's own server: its ``/v1/load_lora_adapter``, in place under one name.
    One inference server only (an adapter swap has no fleet-wide fallback yet)."""

    def __init__(self, config: TrainingConfig, model: Any, tokenizer: Any) -> None:
        super().__init__(config, model, tokenizer)
        if len(self.urls) > 1:
            raise WeightSyncError(
                f"lora_only updates one inference server; got {len(self.urls)} "
                "(inference_urls): use http_reload for a fleet"
            )

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
