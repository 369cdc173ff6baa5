"""The original trainer's ``vllm_manager`` functions: one tracked inference server process.

``launch_vllm_server`` starts a server (vLLM when installed, else ``atropos-serve-model``)
on the config's ``vllm_port`` and remembers it; the other functions check, swap LoRA
adapters into, and stop that process. The process itself is an
:class:`~example_trainer.launch.inference_process.InferenceProcess`; the trainer's own modes use
that module directly.

Unlike the original, ``kill_process_on_port`` ends only processes this trainer started
(its own descendants): a foreign process holding the port is reported, never killed.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from typing import Any

import httpx

from .launch.inference_process import (
    InferenceProcess,
    InferenceServerError,
    port_is_free,
    server_command,
)

__all__ = [
    "check_vllm_health",
    "check_vllm_process_health",
    "cleanup_vllm",
    "get_vllm_process",
    "hotswap_lora_adapter",
    "is_port_in_use",
    "kill_process_on_port",
    "launch_vllm_server",
    "server_command",  # defined in .inference_process; importable from here as before
    "set_vllm_process",
    "terminate_vllm_process",
    "wait_for_vllm_ready",
]

logger = logging.getLogger(__name__)

_process: subprocess.Popen | None = None
_launched: InferenceProcess | None = None  # the server behind _process, when launched here


def is_port_in_use(port: int) -> bool:
    """Whether something listens on 127.0.0.1:``port``."""
    return not port_is_free(port)


def _own_descendants() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}


def kill_process_on_port(port: int, timeout: float = 5.0) -> bool:
    """End the process listening on ``port`` when this trainer started it; whether the
    port is free afterwards. A process this trainer did not start is left alone (logged)."""
    import psutil

    if not is_port_in_use(port):
        return True
    own = _own_descendants()
    holders = {
        c.pid
        for c in psutil.net_connections(kind="inet")
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid
    }
    foreign = holders - own
    if foreign:
        logger.warning(
            "port %d is held by process(es) %s, which this trainer did not start; not killing",
            port,
            sorted(foreign),
        )
    victims = [psutil.Process(pid) for pid in holders & own]
    for proc in victims:
        proc.terminate()
    _, alive = psutil.wait_procs(victims, timeout=timeout)
    for proc in alive:
        proc.kill()
    psutil.wait_procs(alive, timeout=timeout)
    deadline = time.monotonic() + timeout
    while is_port_in_use(port) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not is_port_in_use(port)


def get_vllm_process() -> subprocess.Popen | None:
    """The tracked inference server process, or None."""
    return _process


def set_vllm_process(proc: subprocess.Popen | None) -> None:
    """Track ``proc`` as the inference server (None forgets it)."""
    global _process, _launched
    _process = proc
    if _launched is not None and getattr(_launched, "proc", None) is not proc:
        _launched = None


def launch_vllm_server(config: Any, model_path: str) -> subprocess.Popen | None:
    """Serve ``model_path`` on ``config.vllm_port`` (vLLM when installed, else
    ``atropos-serve-model``; ``config.inference_backend`` when the config has one), wait
    until it is healthy and track it; the process, or None when it could not start."""
    global _launched
    terminate_vllm_process()
    launched = InferenceProcess(
        getattr(config, "inference_backend", "auto"),
        int(config.vllm_port),
        served_model_name=getattr(config, "model_name", None),
        log_path=None,
        timeout=float(getattr(config, "vllm_start_timeout", 600.0) or 600.0),
        gpu_memory_utilization=float(getattr(config, "vllm_gpu_memory_utilization", 0.45)),
        max_model_len=getattr(config, "max_model_len", None),
        gpu=getattr(config, "vllm_gpu", None),
    )
    try:
        launched.start(model_path)
    except InferenceServerError as exc:
        logger.error("could not start the inference server: %s", exc)
        return None
    _launched = launched
    set_vllm_process(launched.proc)
    return launched.proc


def terminate_vllm_process() -> None:
    """Stop the tracked server (its whole process group) and forget it."""
    global _launched
    launched, proc = _launched, _process
    _launched = None
    set_vllm_process(None)
    if launched is not None:
        launched.stop()
    elif proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


def cleanup_vllm() -> None:
    """Stop the tracked server, if any (for ``atexit`` and signal handlers)."""
    terminate_vllm_process()


def check_vllm_process_health() -> None:
    """RuntimeError naming the exit code when the tracked server has died."""
    proc = _process
    if proc is not None and proc.poll() is not None:
        raise RuntimeError(f"the inference server exited with code {proc.returncode}")


def check_vllm_health(port: int) -> bool:
    """Whether the server on ``port`` answers ``GET /health`` with 200."""
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for_vllm_ready(port: int, timeout: float = 120.0) -> bool:
    """Whether the server on ``port`` becomes healthy within ``timeout`` seconds (False
    at once when the tracked process dies)."""
    deadline = time.monotonic() + timeout
    while True:
        if check_vllm_health(port):
            return True
        proc = _process
        if proc is not None and proc.poll() is not None:
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)


def hotswap_lora_adapter(adapter_name: str, adapter_path: str, port: int) -> bool:
    """Load the LoRA adapter at ``adapter_path`` into the server on ``port``: the bridge's
    ``POST /lora/load``, else vLLM's ``POST /v1/load_lora_adapter``; whether one took it."""
    base = f"http://127.0.0.1:{port}"
    attempts = (
        ("/lora/load", {"adapter_path": adapter_path, "adapter_name": adapter_name}),
        ("/v1/load_lora_adapter", {"lora_name": adapter_name, "lora_path": adapter_path}),
    )
    for path, body in attempts:
        try:
            response = httpx.post(base + path, json=body, timeout=120.0)
        except httpx.HTTPError as exc:
            logger.warning("LoRA load via %s failed: %s", path, exc)
            continue
        if response.status_code == 200:
            return True
        logger.warning("LoRA load via %s answered %d", path, response.status_code)
    return False
