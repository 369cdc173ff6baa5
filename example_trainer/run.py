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
from typing import Any, Dict, List, NoReturn, Sequence

import httpx
from pydantic import ValidationError

from atroposlib.utils.settings_cli import add_fields

from . import config_file
from .launch import supervision
from .launch.launcher import Launcher, as_flags, busy_ports
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
    """Merge the YAML file and flags into a :class:`RunConfig` (exit 2 on bad input: a flag's
    mistake names the flag, the file's names the file and the key path)."""
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
            data = config_file.load(ns.config)
        except config_file.ConfigFileError as exc:
            _fail(str(exc))
        from .config import TrainingConfig

        unknown = config_file.unknown_keys(data, RunConfig, {"trainer": TrainingConfig})
        if unknown:
            _fail("; ".join(f"{ns.config}: {u}" for u in unknown))
    flags = {key for key in _DIRECT if key in ns}  # given on the command line: override the file
    for key in flags:
        data[key] = getattr(ns, key)
    if ns.training_steps is not None:
        if not isinstance(data.get("trainer", {}), dict):
            _fail(f"{ns.config}: trainer: must be a mapping of atropos-grpo settings")
        data.setdefault("trainer", {})["training_steps"] = ns.training_steps
    if ns.no_warmup:
        data["warmup"] = None
        flags.add("warmup")
    if ns.no_eval:
        data["eval"] = None
        flags.add("eval")
    data["trainer_args"] = list(data.get("trainer_args", [])) + trainer_args
    try:
        cfg = RunConfig(**data)
    except ValidationError as exc:
        _fail(config_file.explain(exc.errors(), ns.config, flags))
    trainer_flags = {"training_steps"} if ns.training_steps is not None else set()
    problem = _trainer_section_problem(cfg, ns.config, trainer_flags)
    if problem:
        _fail(problem)
    _check_trainer_settings(cfg)
    return cfg


def _fail(message: str) -> NoReturn:
    """One line naming what to fix, exit status 2 (no usage block: the flags parsed)."""
    print(f"atropos-grpo-run: error: {message}", file=sys.stderr)
    sys.exit(2)


def _trainer_settings(cfg: RunConfig) -> Dict[str, Any]:
    """The trainer's settings the launcher decides (device, bridge mode, world size)."""
    launcher_side = {"device": cfg.trainer_device(), "weight_bridge_mode": cfg.weight_bridge_mode}
    if cfg.precision != "auto":
        launcher_side["precision"] = cfg.precision
    world = cfg.trainer_procs * cfg.nnodes
    return {**launcher_side, **({"world_size": world} if world > 1 else {})}


def _trainer_section_problem(cfg: RunConfig, path: str | None, flags: set) -> str | None:
    """The errors of the ``trainer:`` section's values, named ``FILE: trainer.key`` (or by
    flag, for ``--training-steps``); None when the section is valid or the errors are not in
    it (the command-line check that follows words those)."""
    from .config import TrainingConfig

    try:
        TrainingConfig(**{**_trainer_settings(cfg), **dict(cfg.trainer), "model_name": "x"})
    except ValidationError as exc:
        mine = [e for e in exc.errors() if e["loc"] and e["loc"][0] in cfg.trainer]
        return config_file.explain(mine, path, flags, prefix="trainer.") if mine else None
    return None


def _check_trainer_settings(cfg: RunConfig) -> None:
    """Validate the trainer's flags now (exit 2), not after the services started."""
    from .cli import config_from_args as trainer_config

    trainer_config(
        [
            *as_flags({**_trainer_settings(cfg), **dict(cfg.trainer)}),
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
    busy = busy_ports(cfg)
    if busy:
        _fail("; ".join(busy))
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
