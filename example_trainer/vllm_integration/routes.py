"""State and the adapter/weight routes of ``example_trainer.vllm_api_server``.

:class:`Served` is the server's one state object (the engine, its options, the bridge's
memory), reached from a request by :func:`served_state`. :func:`install_lora_routes` adds
``/lora/status|load|unload``; :func:`install_weight_routes` adds vLLM's weight routes
(``/weight_info``, ``/update_weight_version``, and in single-copy mode the weight-transfer
routes). vLLM is imported inside the functions, so this module imports without it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from argparse import Namespace
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from atroposlib.http.openai_protocol import InvalidRequest, OpenAIError
from example_trainer.vllm_integration.bridge import (
    BridgeState,
    LoraLoadRequest,
    LoraStatusResponse,
    available_adapters,
)

__all__ = [
    "Conflict",
    "Served",
    "install_lora_routes",
    "install_weight_routes",
    "served_state",
    "weight_version",
]

logger = logging.getLogger(__name__)


class Conflict(OpenAIError):
    """A route that the server's start-up options rule out (409)."""

    status = 409
    type = "conflict_error"


class Served:
    """The server's state: the engine, its options and the bridge's memory."""

    def __init__(self, engine: Any, args: Namespace, shared: bool) -> None:
        from vllm import SamplingParams

        self.engine = engine
        self.args = args
        self.shared = shared
        self.bridge = BridgeState()
        self.sampling_fields = frozenset(getattr(SamplingParams, "__struct_fields__", ()))

    @property
    def model_config(self) -> Any:
        return self.engine.model_config

    @property
    def lora_enabled(self) -> bool:
        return self.engine.vllm_config.lora_config is not None

    def lora_request(self) -> Any:
        """The active adapter as a vLLM ``LoRARequest``, or None."""
        b = self.bridge
        if b.active_lora_path is None:
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest(
            lora_name=b.active_lora_name or "default_adapter",
            lora_int_id=b.active_lora_id,
            lora_path=b.active_lora_path,
        )


def served_state(request: Request) -> Served:
    """The server's state, from any request."""
    return request.app.state.served


async def weight_version(served: Served) -> str | None:
    """vLLM's weight version, or None where the engine has none."""
    try:
        return await served.engine.get_weight_version()
    except Exception:  # an engine without versions: the answer just names none
        logger.debug("weight version unavailable", exc_info=True)
        return None


def install_lora_routes(app: FastAPI) -> None:
    """``/lora/status``, ``/lora/load``, ``/lora/unload``."""

    @app.get("/lora/status")
    async def lora_status(request: Request) -> LoraStatusResponse:
        served = served_state(request)
        b = served.bridge
        return LoraStatusResponse(
            lora_available=served.lora_enabled,
            active_adapter_path=b.active_lora_path,
            active_adapter_name=b.active_lora_name,
            active_adapter_id=b.active_lora_id if b.active_lora_path else None,
            load_count=b.lora_load_count,
            available_adapters=available_adapters(os.environ.get("LOGDIR", ".")),
        )

    @app.post("/lora/load")
    async def lora_load(body: LoraLoadRequest, request: Request) -> JSONResponse:
        """Load the adapter into the engine, then serve every ``/generate`` with it."""
        from vllm.lora.request import LoRARequest

        served = served_state(request)
        path = Path(body.adapter_path)
        if not path.is_dir():
            raise InvalidRequest(
                f"adapter not found: {body.adapter_path}", param="adapter_path", status=404
            )
        if not served.lora_enabled:
            raise Conflict("LoRA needs the server started with --enable-lora")
        config: dict[str, Any] = {}
        try:
            raw = json.loads((path / "adapter_config.json").read_text())
            config = {
                "r": raw.get("r"),
                "lora_alpha": raw.get("lora_alpha"),
                "target_modules": raw.get("target_modules"),
                "base_model": raw.get("base_model_name_or_path"),
            }
        except (OSError, ValueError) as e:
            raise InvalidRequest(
                f"{body.adapter_path} has no readable adapter_config.json: {e}",
                param="adapter_path",
            ) from None
        b = served.bridge
        new_id = b.lora_load_count + 1
        name = body.adapter_name or f"adapter_{b.lora_load_count}"
        try:
            await served.engine.add_lora(
                LoRARequest(lora_name=name, lora_int_id=new_id, lora_path=str(path))
            )
        except Exception as e:  # the engine refused the adapter: the old one keeps serving
            logger.warning("LoRA adapter %s refused: %s", path, e)
            raise InvalidRequest(
                f"the engine could not load {body.adapter_path}: {e}", param="adapter_path"
            ) from None
        previous = b.active_lora_id if b.active_lora_path else None
        with b.lock:
            b.active_lora_path, b.active_lora_name = str(path), name
            b.active_lora_id, b.lora_load_count = new_id, new_id
        if previous is not None:
            await served.engine.remove_lora(previous)
        logger.info("LoRA adapter loaded: %s (id=%d)", path, new_id)
        return JSONResponse(
            {
                "status": "ok",
                "adapter_path": str(path),
                "adapter_name": name,
                "adapter_id": new_id,
                "load_count": b.lora_load_count,
                "adapter_config": config,
            }
        )

    @app.post("/lora/unload")
    async def lora_unload(request: Request) -> JSONResponse:
        served = served_state(request)
        b = served.bridge
        with b.lock:
            prev_path, prev_name, prev_id = b.active_lora_path, b.active_lora_name, b.active_lora_id
            b.active_lora_path, b.active_lora_name, b.active_lora_id = None, None, 0
        if prev_path is not None:
            await served.engine.remove_lora(prev_id)
        return JSONResponse(
            {"status": "ok", "previous_adapter": prev_path, "previous_name": prev_name}
        )


def install_weight_routes(app: FastAPI) -> None:
    """vLLM's ``/weight_info`` and ``/update_weight_version``, and the weight-transfer routes."""

    @app.get("/weight_info")
    async def weight_info(request: Request) -> JSONResponse:
        return JSONResponse({"weight_version": await weight_version(served_state(request))})

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> JSONResponse:
        body = await json_object(request)
        version = body.get("new_version")
        if not isinstance(version, (str, int)) or isinstance(version, bool):
            raise InvalidRequest("'new_version' must be a string", param="new_version")
        await served_state(request).engine.update_weight_version(str(version))
        return JSONResponse({"success": True, "new_version": str(version)})

    _install_weight_transfer_routes(app)


async def json_object(request: Request) -> dict[str, Any]:
    """The request body, which must be a JSON object (else a 400)."""
    try:
        body = await request.json()
    except ValueError as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


def _install_weight_transfer_routes(app: FastAPI) -> None:
    """vLLM's weight-transfer routes (same paths and bodies as its own server), live in
    single-copy mode only: the trainer sends its weights through vLLM's IPC engine."""

    def shared(request: Request) -> Served:
        served = served_state(request)
        if not served.shared:
            raise Conflict(
                "weight transfer needs the server started with VLLM_ENABLE_SHARED_WEIGHTS=1"
            )
        return served

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(request: Request) -> JSONResponse:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        served = shared(request)
        init_info = (await json_object(request)).get("init_info") or {}
        if not isinstance(init_info, dict):
            raise InvalidRequest("'init_info' must be an object", param="init_info")
        await served.engine.init_weight_transfer_engine(
            WeightTransferInitRequest(init_info=init_info)
        )
        return JSONResponse({"message": "Weight transfer initialized"})

    @app.post("/start_weight_update")
    async def start_weight_update(request: Request) -> JSONResponse:
        await shared(request).engine.start_weight_update()
        return JSONResponse({"message": "Weight update started"})

    @app.post("/update_weights")
    async def update_weights(request: Request) -> JSONResponse:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        served = shared(request)
        update_info = (await json_object(request)).get("update_info")
        if not isinstance(update_info, dict):
            raise InvalidRequest("'update_info' must be an object", param="update_info")
        await served.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info))
        return JSONResponse({"message": "Weights updated"})

    @app.post("/finish_weight_update")
    async def finish_weight_update(request: Request) -> JSONResponse:
        served = shared(request)
        version = (await json_object(request)).get("weight_version")
        await served.engine.finish_weight_update(None if version is None else str(version))
        with served.bridge.lock:
            served.bridge.update_count += 1
            served.bridge.last_update_time = time.time()
        return JSONResponse({"message": "Weight update finished"})
