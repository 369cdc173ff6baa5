"""The inference server process: its command line, start, health and port.

:class:`InferenceProcess` is one server child the trainer owns (the ``none`` and
``lora_restart`` weight-bridge modes restart it on each new checkpoint, see
:mod:`example_trainer.weight_sync`); :func:`server_command` is the command line
``atropos-grpo-run`` starts its own server with (:mod:`example_trainer.launch.launcher`). Works
with vLLM (``python -m vllm.entrypoints.openai.api_server``) and with
``atropos-serve-model``.

Unlike the original, it never kills foreign processes that hold the port: a busy
port is a clear error. The child runs in its own process group and is killed with
it; every wait is bounded by a timeout.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Mapping, Tuple

import httpx

from atroposlib.utils.processes import stop_process_group

from .supervision import die_with_parent

logger = logging.getLogger(__name__)


class InferenceServerError(RuntimeError):
    """The inference server could not be started, reached or stopped in time."""


VLLM_SERVE_ENV: dict[str, str] = {
    # vLLM's RL routes (/pause, /resume, /collective_rpc, /update_weight_version, /weight_info):
    # how http_reload puts new weights in place and names their version.
    "VLLM_SERVER_DEV_MODE": "1",
    # /v1/load_lora_adapter at run time (lora_only).
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
"""Environment of a vLLM server the trainer or ``atropos-grpo-run`` starts (on top of theirs)."""


def vllm_python() -> str | None:
    """The interpreter that runs vLLM: ``ATROPOS_VLLM_PYTHON``, else ``.venv-vllm/bin/python``
    (in the working directory or next to this package) when present, else this interpreter
    when it has vLLM; None when there is none."""
    override = os.environ.get("ATROPOS_VLLM_PYTHON")
    if override:
        return override
    for root in (Path.cwd(), Path(__file__).resolve().parents[1]):
        venv = root / ".venv-vllm" / "bin" / "python"
        if venv.exists():
            return str(venv)
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def resolve_backend(backend: str) -> str:
    """``auto`` → ``vllm`` when a vLLM interpreter is found, else ``serve_model``."""
    if backend != "auto":
        return backend
    return "vllm" if vllm_python() is not None else "serve_model"


def server_command(
    backend: str,
    model_path: str,
    port: int,
    served_model_name: str | None = None,
    host: str = "127.0.0.1",
    gpu_memory_utilization: float = 0.45,
    max_model_len: int | None = None,
    device: str | None = None,
    dtype: str | None = None,
) -> List[str]:
    """The command line that serves ``model_path`` on ``port``.

    ``device`` (``cpu``/``cuda``; atropos-serve-model only, vLLM picks its GPUs from
    ``CUDA_VISIBLE_DEVICES``) and ``dtype`` are passed on unless None or ``auto``.
    """
    backend = resolve_backend(backend)
    dtype = None if dtype in (None, "auto") else dtype
    if backend == "vllm":
        python = vllm_python()
        if python is None:
            raise InferenceServerError(
                "no vLLM found: build .venv-vllm (make .venv-vllm) or set ATROPOS_VLLM_PYTHON"
            )
        cmd = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model_path,
            "--host",
            host,
            "--port",
            str(port),
            "--dtype",
            dtype or "auto",
            "--gpu-memory-utilization",
            str(gpu_memory_utilization),
        ]
        if max_model_len:
            cmd += ["--max-model-len", str(max_model_len)]
    elif backend == "serve_model":
        cmd = [
            sys.executable,
            "-m",
            "atroposlib.cli.serve_model",
            model_path,
            "--host",
            host,
            "--port",
            str(port),
        ]
        if device not in (None, "auto"):
            cmd += ["--device", str(device)]
        if dtype:
            cmd += ["--dtype", dtype]
    else:
        raise InferenceServerError(f"unknown inference backend {backend!r} (vllm | serve_model)")
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    return cmd


def split_device(device: str) -> Tuple[str, Mapping[str, str]]:
    """``cuda:N`` → (``cuda``, ``{"CUDA_VISIBLE_DEVICES": "N"}``); other devices unchanged.

    Inference servers take a device kind, not an index: the index selects the GPU
    they see instead.
    """
    kind, _, index = device.partition(":")
    if kind == "cuda" and index:
        return "cuda", {"CUDA_VISIBLE_DEVICES": index}
    return device, {}


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True if nothing listens on ``host:port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) != 0


def wait_healthy(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Poll ``{url}/health`` until 200; raise :class:`InferenceServerError` on timeout or early exit."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise InferenceServerError(
                f"inference server exited with code {proc.returncode} before becoming healthy"
            )
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError as exc:
            last = str(exc)
        time.sleep(0.2)
    raise InferenceServerError(
        f"inference server at {url} not healthy within {timeout:.0f}s ({last})"
    )


class InferenceProcess:
    """One inference server child process, restartable on a new model path."""

    def __init__(
        self,
        backend: str,
        port: int,
        served_model_name: str | None,
        log_path: Path | None,
        timeout: float,
        gpu_memory_utilization: float = 0.45,
        max_model_len: int | None = None,
        gpu: int | None = None,
    ) -> None:
        self.backend = resolve_backend(backend)
        self.port = port
        self.served_model_name = served_model_name
        self.log_path = log_path
        self.timeout = timeout
        self.gpu_memory_utilization = gpu_memory_utilization
        self.max_model_len = max_model_len
        self.gpu = gpu
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """Base URL of the server."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, model_path: str) -> None:
        """Start serving ``model_path`` and wait until healthy."""
        if self.proc is not None and self.proc.poll() is None:
            raise InferenceServerError("inference server already running")
        if not port_is_free(self.port):
            raise InferenceServerError(
                f"port {self.port} is already in use; stop whatever listens there or pick another --vllm-port"
            )
        cmd = server_command(
            self.backend,
            model_path,
            self.port,
            self.served_model_name,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_model_len=self.max_model_len,
        )
        env = dict(os.environ)
        if self.backend == "vllm":
            env.update(VLLM_SERVE_ENV)
        if self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(self.gpu)
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            logger.info("starting inference server: %s", " ".join(cmd))
            # The server dies with its owner (a trainer rank), even one killed with SIGKILL.
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        finally:
            if self.log_path:
                out.close()
        try:
            wait_healthy(self.url, self.timeout, self.proc)
        except InferenceServerError:
            self.stop()
            raise

    def stop(self, timeout: float = 15.0) -> None:
        """Terminate the server's process group (SIGKILL after ``timeout`` s)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        stop_process_group(proc, timeout)
        deadline = time.monotonic() + timeout
        while not port_is_free(self.port) and time.monotonic() < deadline:
            time.sleep(0.1)

    def restart(self, model_path: str) -> None:
        """Stop, then serve ``model_path``."""
        self.stop()
        self.start(model_path)
