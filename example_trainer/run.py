"""``atropos-grpo-run``: the whole RL loop with one command.

Starts ``run-api``, the inference server (``atropos-serve-model`` with the offline
tiny model by default, vLLM when asked), one or more environments and the GRPO
trainer as child processes; shows their status in one place; writes each one's
log to ``RUN_DIR/logs/``; and stops everything on exit, on any child's failure, on
Ctrl-C or SIGTERM, and (through the kernel's parent-death signal, which every child
and every trainer rank sets) even if the launcher is killed with ``kill -9``: no
process of the run outlives it (see :mod:`example_trainer.launch.supervision`).

Optionally (the CPU demo turns these on) it first gives the model a short cached
supervised warm-up on the task format, evaluates before and after training,
and writes ``curve.png`` and ``summary.json``/``summary.md`` to the run directory.

This module is the command line; the pieces live in :mod:`.launch`: :mod:`.launch.run_config`
(what to run), :mod:`.launch.launcher` (the processes), :mod:`.launch.evaluation`,
:mod:`.launch.status` (the live view) and :mod:`.launch.summary` (results on disk).

Examples::

    atropos-grpo-run --config example_trainer/configs/demo_cpu.yaml
    atropos-grpo-run --model ./my-model --env environments/arithmetic_server.py -- --lr 1e-4 --training-steps 50
    atropos-grpo-run --model ./my-model --device cuda --trainer-procs 2 --inference-device cuda:2
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence

import httpx
import yaml
from pydantic import ValidationError

from atroposlib.utils.settings_cli import add_fields

from .launch import supervision
from .launch.launcher import Launcher, as_flags
from .launch.processes import TRAINER_STOP_TIMEOUT
from .launch.run_config import EvalSection, RunConfig, WarmupSection
from .launch.summary import clear_previous_run, plot_curve, read_metrics
from .plugins import load_function
from .vllm_manager import wait_for_vllm_ready

__all__ = [
    "EvalSection",
    "Launcher",
    "RunConfig",
    "WarmupSection",
    "build_parser",
    "clear_previous_run",
    "config_from_args",
    "load_function",
    "main",
    "plot_curve",
    "read_metrics",
    "wait_for_bridge_config",
    "wait_for_vllm",
]

logger = logging.getLogger("atropos-grpo-run")

# RunConfig fields that are flags (the rest are set in the YAML file).
_DIRECT = (
    "run_dir",
    "model",
    "api_port",
    "max_staleness",
    "inference_port",
    "inference_backend",
    "inference_device",
    "inference_dtype",
    "device",
    "precision",
    "trainer_procs",
    "weight_bridge_mode",
    "envs",
    "group_size",
    "max_wall_time",
    "nnodes",
    "node_rank",
    "rdzv_endpoint",
    "rdzv_backend",
    "rdzv_id",
    "trainer_only",
    "api_host",
    "api_url",
    "inference_urls",
    "inference_urls_file",
)


def build_parser() -> argparse.ArgumentParser:
    """Flags of ``atropos-grpo-run``; everything after ``--`` goes to the trainer."""
    p = argparse.ArgumentParser(
        prog="atropos-grpo-run",
        allow_abbrev=False,
        usage="atropos-grpo-run [--config RUN.yaml] [options] [-- TRAINER FLAGS]",
        description="Start run-api, an inference server, environments and the GRPO trainer; stop them all on exit.",
    )
    p.add_argument("--config", help="YAML file with RunConfig fields.")
    add_fields(p, RunConfig, _DIRECT)
    p.add_argument(
        "--training-steps", type=int, help="Shortcut for the trainer's --training-steps."
    )
    p.add_argument(
        "--no-warmup", action="store_true", help="Skip the supervised warm-up of the config."
    )
    p.add_argument("--no-eval", action="store_true", help="Skip evaluation.")
    return p


def config_from_args(argv: Sequence[str] | None = None) -> RunConfig:
    """Merge the YAML file and flags into a :class:`RunConfig` (exit 2 on bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    trainer_args: List[str] = []
    if "--" in argv:
        idx = argv.index("--")
        argv, trainer_args = argv[:idx], argv[idx + 1 :]
    parser = build_parser()
    ns = parser.parse_args(argv)
    data: Dict[str, Any] = {}
    if ns.config:
        try:
            data = yaml.safe_load(Path(ns.config).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            parser.error(f"--config: {exc}")
        if not isinstance(data, dict):
            parser.error("--config: the YAML file must hold a mapping")
    for key in _DIRECT:
        if key in ns:  # given on the command line: overrides the YAML file
            data[key] = getattr(ns, key)
    if ns.training_steps is not None:
        data.setdefault("trainer", {})["training_steps"] = ns.training_steps
    if ns.no_warmup:
        data["warmup"] = None
    if ns.no_eval:
        data["eval"] = None
    data["trainer_args"] = list(data.get("trainer_args", [])) + trainer_args
    try:
        cfg = RunConfig(**data)
    except ValidationError as exc:
        parser.error("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))
    _check_trainer_settings(cfg)
    return cfg


def _check_trainer_settings(cfg: RunConfig) -> None:
    """Validate the trainer's flags now (exit 2), not after the services started."""
    from .cli import config_from_args as trainer_config

    launcher_side = {"device": cfg.trainer_device(), "weight_bridge_mode": cfg.weight_bridge_mode}
    if cfg.precision != "auto":
        launcher_side["precision"] = cfg.precision
    world = cfg.trainer_procs * cfg.nnodes
    env_world = {"world_size": world} if world > 1 else {}
    trainer_config(
        [
            *as_flags({**launcher_side, **env_world, **dict(cfg.trainer)}),
            *cfg.trainer_args,
            "--model-name",
            "x",
        ],
        prog="atropos-grpo-run (trainer settings)",
    )


def _on_signal(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``atropos-grpo-run``."""
    cfg = config_from_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)
    # Orphaned descendants (a rank whose torchrun died) become ours, so shutdown finds them.
    supervision.become_subreaper()
    launcher = Launcher(cfg)
    print(f"run directory: {launcher.run_dir}", flush=True)
    try:
        return launcher.run()
    except KeyboardInterrupt:
        logger.warning("interrupted; stopping all processes")
        return 130
    except (RuntimeError, OSError, ValueError, httpx.HTTPError) as exc:
        logger.error("%s", exc)
        return 1
    finally:
        # A second Ctrl-C or SIGTERM must not cut the shutdown short and leave children
        # behind; the shutdown itself is bounded (about TRAINER_STOP_TIMEOUT seconds).
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        logger.info("stopping all processes (at most %.0fs)", TRAINER_STOP_TIMEOUT)
        launcher.shutdown()


# --- the original's waits --------------------------------------------------------------------


def wait_for_vllm(port: int, timeout: int = 300) -> bool:
    """Whether the inference server on ``port`` answers ``/health`` within ``timeout`` s."""
    return wait_for_vllm_ready(port, float(timeout))


def wait_for_bridge_config(config_path: str, timeout: int = 60) -> bool:
    """Whether the JSON file ``config_path`` (written by the inference side) exists and
    parses within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    path = Path(config_path)
    while True:
        try:
            json.loads(path.read_text())
            return True
        except (OSError, ValueError):
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
