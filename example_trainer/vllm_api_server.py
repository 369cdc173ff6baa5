"""The original's vLLM server for the trainer, on today's vLLM (0.32): ``/generate`` and the
bridge (``/bridge/*``, ``/lora/*``) over vLLM's public engine API (``AsyncLLM``).

Run it as the original documents::

    python -m example_trainer.vllm_api_server --model MODEL --port 9001 [vLLM engine flags]

Routes: ``GET /health``, ``GET /health_generate``, ``POST /generate`` (the original's request
and answer, see :func:`example_trainer.vllm_integration.bridge.generate_answer`),
``/bridge/info|state_dict_info|pause|resume|is_paused|sleep|wake_up|is_sleeping|debug|list_endpoints``,
``/lora/status|load|unload``, and vLLM's weight routes ``GET /weight_info``,
``POST /update_weight_version`` and, in single-copy mode, ``POST /init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update`` (the bodies vLLM's own
server takes).

Differences from the original's file (which does not start on the vLLM we support: it imports
``vllm.entrypoints.launcher``, which vLLM does not have): nothing in vLLM is patched. Single-copy mode (``VLLM_ENABLE_SHARED_WEIGHTS=1``,
``weight_bridge_mode shared_vllm``) starts the engine with vLLM's own IPC weight-transfer
engine; without CUDA the server exits at start with one line saying why and what to use
instead. ``/bridge/pause`` uses vLLM's pause (``mode`` ``keep`` by default: queued and running
requests wait and go on after ``/bridge/resume``). ``/lora/load`` loads the adapter into the
engine before answering, so a broken adapter is a 400 and the previous one keeps serving. The
server follows the project's security model (docs/design.md, "Security model"): it binds
127.0.0.1 unless ``--host`` says otherwise, takes a key from ``ATROPOS_API_KEY`` or
``--api-key-file``, and a sampling value outside its bounds is a 400 naming the field.

Importing this module without vLLM raises ImportError naming ``make .venv-vllm`` and the extra.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import ssl
import sys
import uuid
from argparse import Namespace
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from atroposlib.http.answers import openai_error_bytes
from atroposlib.http.headers import POLICY_VERSION_HEADER
from atroposlib.http.openai_protocol import (
    InvalidRequest,
    install_error_handlers,
    unless_disconnected,
)
from atroposlib.http.security import load_api_key
from atroposlib.http.server import ServerOptions, build_server
from example_trainer._needs_vllm import require_vllm
from example_trainer.vllm_integration.bridge import (
    BridgeInfoResponse,
    BridgeState,
    LoraLoadRequest,
    LoraStatusResponse,
    generate_answer,
    parse_generate,
    shared_weights_problem,
    shared_weights_requested,
)
from example_trainer.vllm_integration.routes import (
    Conflict,
    Served,
    install_lora_routes,
    install_weight_routes,
    served_state,
    weight_version,
)

# The imports above need no vLLM (its modules are imported where they are used); without it,
# importing this module stops here with one message naming the venv and the extra.
require_vllm(__name__)

__all__ = [
    "PATCHES_APPLIED",
    "BridgeInfoResponse",
    "BridgeState",
    "LoraLoadRequest",
    "LoraStatusResponse",
    "build_app",
    "init_app",
    "main",
    "run_server",
]

logger = logging.getLogger(__name__)

PATCHES_APPLIED: bool = False
"""Always False: vLLM is not patched. Single-copy mode goes through vLLM's own weight-transfer
engine instead (``/bridge/info`` reports it as ``shared_weights``)."""

MAX_BODY_BYTES = 64 << 20
PAUSE_MODES = ("keep", "wait", "abort")


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _client_error(exc: BaseException) -> InvalidRequest | None:
    """vLLM's request errors (bad sampling values, a prompt longer than the context) as a 400
    naming the parameter where vLLM names it; None for anything else."""
    from vllm.exceptions import VLLMClientError

    if isinstance(exc, (VLLMClientError, ValueError, TypeError)):
        return InvalidRequest(str(exc), param=getattr(exc, "parameter", None))
    return None


def _version_headers(version: str | None) -> dict[str, str]:
    if version is not None and version.strip().lstrip("-").isdigit():
        return {POLICY_VERSION_HEADER: version.strip()}
    return {}


async def _generate(served: Served, body: Any, request: Request) -> Response:
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    stream = bool(body.pop("stream", False)) if isinstance(body, dict) else False
    call = parse_generate(body, served.sampling_fields)
    kind = RequestOutputKind.CUMULATIVE if stream else RequestOutputKind.FINAL_ONLY
    try:
        params = SamplingParams(**call.sampling, output_kind=kind)
    except Exception as e:
        err = _client_error(e)
        if err is None:
            raise
        raise err from None
    version = await weight_version(served)
    request_id = uuid.uuid4().hex
    results = served.engine.generate(
        call.prompt, params, request_id, lora_request=served.lora_request()
    )

    async def first_output() -> Any:
        # vLLM checks the prompt (e.g. its length) when the request is added, that is at the
        # first step of the generator: its refusals are the client's errors.
        try:
            return await anext(results)
        except StopAsyncIteration:
            raise RuntimeError("the engine returned no output") from None
        except Exception as e:
            err = _client_error(e)
            if err is None:
                raise
            raise err from None

    async def prompt_text(output: Any) -> str:
        if call.prompt_text is not None:
            return call.prompt_text
        if output.prompt:
            return output.prompt
        tokenizer = served.engine.get_tokenizer()
        return await asyncio.to_thread(tokenizer.decode, list(output.prompt_token_ids))

    if stream:
        first = await first_output()

        async def lines() -> AsyncIterator[bytes]:
            output = first
            while output is not None:
                prefix = await prompt_text(output)
                texts = [prefix + o.text for o in output.outputs]
                yield (json.dumps({"text": texts}) + "\n").encode()
                output = await anext(results, None)

        return StreamingResponse(lines(), headers=_version_headers(version))

    async def last() -> Any:
        final = await first_output()  # FINAL_ONLY: the one output is the finished request
        async for output in results:
            final = output
        return final

    final = await unless_disconnected(request, last())
    answer = generate_answer(
        await prompt_text(final),
        final.prompt_token_ids,
        final.outputs,
        call.want_logprobs,
        final.prompt_logprobs if call.want_prompt_logprobs else None,
    )
    return JSONResponse(answer, headers=_version_headers(version))


def _install_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> Response:
        """200 while the engine runs, 503 once it died."""
        return Response(status_code=503 if served_state(request).engine.errored else 200)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        """200 after the engine generated one token."""
        from vllm import SamplingParams

        served = served_state(request)
        params = SamplingParams(max_tokens=1, temperature=0.0)
        async for _ in served.engine.generate({"prompt_token_ids": [0]}, params, uuid.uuid4().hex):
            pass
        return Response(status_code=200)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        """The original's ``/generate``: ``prompt`` (text or ``{"prompt_token_ids"}``) plus
        sampling parameters."""
        try:
            body = await request.json()
        except ValueError as e:
            raise InvalidRequest(f"request body is not valid JSON: {e}") from None
        return await _generate(served_state(request), body, request)

    @app.get("/bridge/info")
    async def bridge_info(request: Request) -> JSONResponse:
        served = served_state(request)
        info = BridgeInfoResponse(
            enabled=served.shared,
            update_count=served.bridge.update_count,
            last_update_time=served.bridge.last_update_time,
            model_name=str(served.model_config.model),
            device=_device(),
        ).model_dump()
        info["shared_weights"] = served.shared
        info["weight_transfer"] = "ipc" if served.shared else None
        return JSONResponse(info)

    @app.get("/bridge/state_dict_info")
    async def bridge_state_dict_info(request: Request) -> JSONResponse:
        served = served_state(request)
        return JSONResponse(
            {
                "model": str(served.model_config.model),
                "dtype": str(served.model_config.dtype),
                "shared_weights_enabled": served.shared,
            }
        )

    @app.post("/bridge/pause")
    async def bridge_pause(request: Request, mode: str = "keep") -> JSONResponse:
        """Stop scheduling: ``keep`` (default) freezes requests until resume, ``wait`` lets
        running ones finish first, ``abort`` ends them."""
        if mode not in PAUSE_MODES:
            raise InvalidRequest(f"'mode' must be one of {', '.join(PAUSE_MODES)}", param="mode")
        await served_state(request).engine.pause_generation(mode=mode)
        return JSONResponse({"status": "paused", "mode": mode})

    @app.post("/bridge/resume")
    async def bridge_resume(request: Request) -> JSONResponse:
        await served_state(request).engine.resume_generation()
        return JSONResponse({"status": "resumed"})

    @app.get("/bridge/is_paused")
    async def bridge_is_paused(request: Request) -> JSONResponse:
        return JSONResponse({"paused": await served_state(request).engine.is_paused()})

    @app.post("/bridge/sleep")
    async def bridge_sleep(request: Request) -> JSONResponse:
        served = served_state(request)
        if not served.model_config.enable_sleep_mode:
            raise Conflict(
                "sleep needs the server started with --enable-sleep-mode (a CUDA feature)"
            )
        await served.engine.sleep()
        return JSONResponse({"status": "sleeping"})

    @app.post("/bridge/wake_up")
    async def bridge_wake_up(request: Request) -> JSONResponse:
        served = served_state(request)
        if not served.model_config.enable_sleep_mode:
            raise Conflict(
                "wake_up needs the server started with --enable-sleep-mode (a CUDA feature)"
            )
        await served.engine.wake_up()
        return JSONResponse({"status": "awake"})

    @app.get("/bridge/is_sleeping")
    async def bridge_is_sleeping(request: Request) -> JSONResponse:
        return JSONResponse({"sleeping": await served_state(request).engine.is_sleeping()})

    @app.get("/bridge/debug")
    async def bridge_debug(request: Request) -> JSONResponse:
        from vllm import __version__ as vllm_version

        served = served_state(request)
        return JSONResponse(
            {
                "engine_type": type(served.engine).__name__,
                "vllm_version": vllm_version,
                "patches_applied": PATCHES_APPLIED,
                "shared_weights": served.shared,
                "shared_weights_env": os.environ.get("VLLM_ENABLE_SHARED_WEIGHTS", "0"),
                "num_inference_nodes": os.environ.get("NUM_INFERENCE_NODES", "unset"),
                "logdir": os.environ.get("LOGDIR", "unset"),
                "model_config": {
                    "model": str(served.model_config.model),
                    "dtype": str(served.model_config.dtype),
                },
            }
        )

    @app.get("/bridge/list_endpoints")
    async def list_endpoints(request: Request) -> JSONResponse:
        endpoints = [
            {"path": route.path, "methods": sorted(route.methods)}
            for route in request.app.routes
            if getattr(route, "methods", None)
        ]
        return JSONResponse({"endpoints": endpoints})

    install_lora_routes(app)
    install_weight_routes(app)


def build_app(args: Namespace) -> FastAPI:
    """The FastAPI app with every route; its engine is attached by :func:`init_app`."""
    app = FastAPI(title="atropos vLLM server", root_path=getattr(args, "root_path", None) or "")
    install_error_handlers(app)
    _install_routes(app)
    return app


def _export_bridge_config(args: Namespace, shared: bool) -> None:
    """``vllm_bridge_config.json`` (``$VLLM_BRIDGE_CONFIG_PATH``, else ``$LOGDIR``), the file
    the trainer waits for in ``shared_vllm`` mode: the model, and how weights reach vLLM."""
    explicit = os.environ.get("VLLM_BRIDGE_CONFIG_PATH")
    path = (
        Path(explicit)
        if explicit
        else Path(os.environ.get("LOGDIR", ".")) / "vllm_bridge_config.json"
    )
    info = {
        "model": getattr(args, "model", None),
        "dtype": str(getattr(args, "dtype", "auto")),
        "tp_degree": getattr(args, "tensor_parallel_size", 1),
        "dp_shard_degree": 1,
        "param_mappings": {},
        "shared_weights_enabled": shared,
        "weight_transfer": "ipc" if shared else None,
        "server": f"http://{args.host}:{args.port}",
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(info, indent=2))
    except OSError as e:
        logger.warning("could not write %s: %s", path, e)


async def init_app(args: Namespace, llm_engine: Any = None) -> FastAPI:
    """Build the app and start (or attach) the engine. In single-copy mode the engine gets
    vLLM's IPC weight-transfer engine."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    shared = shared_weights_requested()
    app = build_app(args)
    engine = llm_engine
    if engine is None:
        engine_args = AsyncEngineArgs.from_cli_args(args)
        if shared:
            from vllm.config.weight_transfer import WeightTransferConfig

            engine_args.weight_transfer_config = WeightTransferConfig(backend="ipc")
        engine = AsyncLLM.from_engine_args(engine_args, usage_context=UsageContext.API_SERVER)
    app.state.served = Served(engine, args, shared)
    app.state.engine_client = engine
    if shared:
        _export_bridge_config(args, shared)
    return app


async def run_server(args: Namespace, llm_engine: Any = None, **uvicorn_kwargs: Any) -> None:
    """Start the engine, serve until stopped, then shut the engine down."""
    import uvicorn
    from vllm import __version__ as vllm_version

    logger.info("vLLM %s; serving on %s:%s", vllm_version, args.host, args.port)
    app = await init_app(args, llm_engine)
    key = load_api_key(None, args.api_key_file, component="vllm_api_server")
    served_app = build_server(
        app,
        ServerOptions(
            bind_host=args.host,
            api_key=key,
            allowed_origins=tuple(args.cors_origin or ()),
            max_body_bytes=MAX_BODY_BYTES,
            shape=openai_error_bytes,
        ),
    )
    if key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("binding %s without an API key: anyone who reaches it can use it", args.host)
    config = uvicorn.Config(
        served_app,
        host=args.host,
        port=args.port,
        log_level=_log_level(args),
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        **uvicorn_kwargs,
    )
    try:
        await uvicorn.Server(config).serve()
    finally:
        engine = app.state.served.engine
        if llm_engine is None:
            engine.shutdown()


def _parser() -> argparse.ArgumentParser:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(
        prog="python -m example_trainer.vllm_api_server",
        description="vLLM with the original's /generate, /bridge/* and /lora/* routes.",
    )
    parser.add_argument("--host", type=str, default="127.0.0.1", help="Bind address.")
    parser.add_argument("--port", type=int, default=9001)
    parser.add_argument("--ssl-keyfile", type=str, default=None)
    parser.add_argument("--ssl-certfile", type=str, default=None)
    parser.add_argument("--ssl-ca-certs", type=str, default=None)
    parser.add_argument("--enable-ssl-refresh", action="store_true", default=False)
    parser.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE))
    parser.add_argument("--root-path", type=str, default=None)
    # --log-level comes with vLLM's engine flags (it sets vLLM's logging too).
    parser.add_argument(
        "--api-key-file",
        type=str,
        default=None,
        help="File holding the API key every route but /health needs "
        "(default: $ATROPOS_API_KEY; none: open to local clients).",
    )
    parser.add_argument(
        "--cors-origin", action="append", default=None, help="Browser origin to allow."
    )
    return AsyncEngineArgs.add_cli_args(parser)


def _log_level(args: Namespace) -> str:
    level = getattr(args, "log_level", None)
    return str(level).lower() if level else "info"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    """``python -m example_trainer.vllm_api_server``: the exit status."""
    if shared_weights_requested():
        problem = shared_weights_problem(_cuda_available())
        if problem is not None:
            print(problem, file=sys.stderr)
            return 2
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=_log_level(args).upper(), format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        load_api_key(None, args.api_key_file, component="vllm_api_server")
    except ValueError as e:
        print(f"vllm_api_server: {e}", file=sys.stderr)
        return 2
    asyncio.run(run_server(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
