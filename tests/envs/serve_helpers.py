"""Command lines of the serve-loop tests (the trivial env, the fake server with a latency) and
reading what an env wrote; the fake trainer is :mod:`atroposlib.testing.trainer`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Dict, List

from atroposlib.testing import launch

ROOT = Path(__file__).resolve().parents[2]
TRIVIAL_ENV = ROOT / "tests" / "envs" / "trivial_env.py"


def fake_server_cmd(port: int, latency_ms: int) -> List[str]:
    """The fake inference server on ``port``, answering after ``latency_ms``."""
    return launch.fake_server_cmd(port, "--latency-ms", str(latency_ms))


def env_cmd(mode: str, api_port: int | None, infer_port: int, *extra: str) -> List[str]:
    """The trivial test env in ``mode`` against the fake server (and the API, when given)."""
    cmd = [
        sys.executable,
        str(TRIVIAL_ENV),
        mode,
        "--openai.base_url",
        f"http://127.0.0.1:{infer_port}/v1",
    ]
    if api_port is not None:
        cmd += ["--env.rollout_server_url", f"http://127.0.0.1:{api_port}"]
    return cmd + list(extra)


def produced_ids(path: Path) -> List[int]:
    """Group ids the env wrote to its jsonl (one line per produced group).

    Later runs with the same path write ``<stem>_1.jsonl`` and so on; those count too.
    """
    ids = []
    for part in sorted(path.parent.glob(f"{path.stem}*{path.suffix}")):
        for line in part.read_text().splitlines():
            group: Dict = json.loads(line)
            ids.append(group["tokens"][0][0])
    return ids
