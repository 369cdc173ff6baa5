"""The teacher of a distillation run: its checkpoint, made once and cached, and its server's flags.

A run config's ``teacher:`` section (:class:`~example_trainer.launch.run_config.TeacherSection`)
names a checkpoint (``model``) or a run config (``from_config``) whose trained
``final_model`` is the teacher. In the second case the launcher first runs that config
as a child ``atropos-grpo-run`` (its own run-api, inference server, environments and
trainer) into ``cache_dir/<key>/run``; ``teacher.json`` beside it records the checkpoint,
how long the run took and its eval, so later runs of the same config (same file content)
serve the cached checkpoint at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

from .launch.processes import ProcessGroup
from .launch.run_config import TeacherSection

logger = logging.getLogger(__name__)

MARKER = "teacher.json"


def teacher_key(config_path: str | Path) -> str:
    """The cache key of ``from_config``: its file name and a hash of its content."""
    path = Path(config_path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    return f"{path.stem}-{digest}"


def cached_teacher(section: TeacherSection) -> Dict[str, Any] | None:
    """``teacher.json`` of ``from_config``'s cached run when its checkpoint is complete, else None."""
    if section.from_config is None:
        return None
    marker = Path(section.cache_dir) / teacher_key(section.from_config) / MARKER
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    model = Path(str(info.get("model", "")))
    if not (model / "config.json").is_file():
        return None
    return info


def build_teacher(
    section: TeacherSection, procs: ProcessGroup, poll: float = 1.0
) -> Dict[str, Any]:
    """Run ``from_config`` as a child ``atropos-grpo-run`` and return its ``teacher.json``
    (``model``: the ``final_model`` directory; ``build_seconds``; ``eval_after``).

    Raises RuntimeError, with the end of the child's log, when the run fails, leaves no
    ``final_model`` or takes longer than ``max_build_time``.
    """
    assert section.from_config is not None
    root = Path(section.cache_dir).resolve() / teacher_key(section.from_config)
    root.mkdir(parents=True, exist_ok=True)
    run_link = root / "run"
    cmd = [
        sys.executable,
        "-m",
        "example_trainer.run",
        "--config",
        str(Path(section.from_config).resolve()),
        "--run-dir",
        str(run_link),
        # Its own limit is teacher.max_build_time: the config's max_wall_time is a demo's
        # bar, and a loaded machine must not leave the teacher half trained.
        "--max-wall-time",
        "0",
    ]
    logger.info("making the teacher: %s (once; cached in %s)", section.from_config, root)
    t0 = time.time()
    child = procs.start("teacher-build", cmd)
    while child.returncode() is None:
        if time.time() - t0 > section.max_build_time:
            procs.stop("teacher-build")
            raise RuntimeError(
                f"teacher.from_config's run took longer than teacher.max_build_time "
                f"({section.max_build_time:.0f}s):\n{child.log_tail()}"
            )
        time.sleep(poll)
    seconds = time.time() - t0
    run_dir = run_link.resolve()
    final = run_dir / "checkpoints" / "final_model"
    if child.returncode() != 0 or not (final / "config.json").is_file():
        raise RuntimeError(
            f"teacher.from_config's run failed (exit {child.returncode()}; no {final}):\n"
            f"{child.log_tail()}"
        )
    # Done: the launcher's watch over its children must not take this exit for a failure.
    procs.children.pop("teacher-build", None)
    # Only the final weights are the teacher: the run's intermediate checkpoints go.
    for step_dir in (run_dir / "checkpoints").glob("step_*"):
        shutil.rmtree(step_dir, ignore_errors=True)
    summary: Dict[str, Any] = {}
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        pass
    info = {
        "model": str(final),
        "from_config": str(section.from_config),
        "build_seconds": round(seconds, 1),
        "eval_before": summary.get("eval_before"),
        "eval_after": summary.get("eval_after"),
        "run_dir": str(run_dir),
    }
    (root / MARKER).write_text(json.dumps(info, indent=2))
    logger.info("teacher made in %.0fs: %s", seconds, final)
    return info


def resolve_teacher(
    section: TeacherSection, procs: ProcessGroup, resolve: Callable[[str], str] = str
) -> Tuple[str, Dict[str, Any], bool]:
    """``(checkpoint, info, built_now)`` for ``section``: ``model`` (through ``resolve``,
    e.g. the launcher's ``tiny`` → directory), or ``from_config``'s cached checkpoint, made
    now when missing."""
    if section.model is not None:
        model = resolve(section.model)
        model = str(Path(model).resolve()) if Path(model).exists() else model
        return model, {"model": model}, False
    info = cached_teacher(section)
    if info is not None:
        logger.info("teacher cached at %s (made in %ss)", info["model"], info.get("build_seconds"))
        return str(info["model"]), info, False
    info = build_teacher(section, procs)
    return str(info["model"]), info, True


def teacher_env_flags(base_url: str, model_name: str, tokenizer: str | None = None) -> List[str]:
    """The ``--teacher.*`` flags that point an environment at the teacher server;
    ``tokenizer`` (the teacher's checkpoint) is what the environment compares with the
    student's tokenizer, since the served name need not be a loadable path."""
    flags = [
        "--teacher.base_url",
        f"{base_url.rstrip('/')}/v1",
        "--teacher.model_name",
        model_name,
        "--teacher.server_type",
        "vllm",
        "--teacher.api_key",
        "x",
    ]
    return flags + (["--teacher.tokenizer_name", tokenizer] if tokenizer else [])
